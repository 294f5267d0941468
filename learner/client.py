"""The learner's side of the wire: typed calls to the Aggregator, with byte accounting.

Every message sent or received is counted in `traffic`, per fragment (common/traffic.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc

from common.codec.fragment import chunks
from common.codec.tensor import CODECS
from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.generated.diloco.v1 import aggregator_pb2_grpc as pb_grpc
from common.rpc import create_channel
from common.traffic import Traffic

UNARY_TIMEOUT_S = 30.0


class AggregatorClient:
    """One channel to the aggregator; thread-safe (sync and heartbeat run on other threads)."""

    def __init__(
        self,
        target: str,
        credentials: grpc.ChannelCredentials | None = None,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """`credentials`: TLS (common/tls.py); None connects in plaintext. `metadata` goes
        with every call (the learner's token, server/rpc/auth.py)."""
        self.target = target
        self._metadata = metadata
        self._channel = create_channel(target, credentials)
        self._stub = pb_grpc.AggregatorStub(self._channel)
        self.traffic = Traffic()

    def close(self) -> None:
        self._channel.close()

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the channel connects; raises grpc.FutureTimeoutError otherwise."""
        self.ready_future().result(timeout=timeout_s)

    def ready_future(self) -> grpc.Future:
        """A future done once the channel connects (cancel it to stop waiting)."""
        return grpc.channel_ready_future(self._channel)

    def join(
        self, learner_id: str, fingerprint: Sequence[pb.ParamSpec], tokens_per_step: int = 0
    ) -> pb.JoinResponse:
        """Open a session. `tokens_per_step` (0: not declared) bounds the tokens this
        learner's pushes may claim (server/influence.py)."""
        request = pb.JoinRequest(
            learner_id=learner_id,
            fingerprint=fingerprint,
            codecs=list(CODECS.values()),
            tokens_per_step=tokens_per_step,
        )
        return self._unary(self._stub.Join, request)

    def push(self, header: pb.PushHeader, payload: bytes) -> pb.PushFragmentResponse:
        """Stream a header and the payload in chunks; returns the server's verdict."""
        header.payload_bytes = len(payload)
        fid = header.fragment_id

        def messages() -> Iterator[pb.PushFragmentRequest]:
            first = pb.PushFragmentRequest(header=header)
            self.traffic.count(fid, sent=first.ByteSize())
            yield first
            for piece in chunks(payload):
                msg = pb.PushFragmentRequest(chunk=piece)
                self.traffic.count(fid, sent=msg.ByteSize())
                yield msg

        response = self._stub.PushFragment(
            messages(), timeout=UNARY_TIMEOUT_S * 4, metadata=self._metadata
        )
        self.traffic.count(fid, received=response.ByteSize())
        return response

    def pull(
        self,
        session_id: str,
        fragment_id: int,
        have_version: int,
        wait_for_version: int = 0,
        wait_timeout_s: float = 0.0,
        slice_of: tuple[int, int] = (0, 0),
    ) -> tuple[pb.PullHeader, bytes]:
        """The fragment's header and serialized payload (empty when already up to date);
        of slice (index, count) only when count > 1 (a rank of a sharded island)."""
        request = pb.PullParamsRequest(
            session_id=session_id,
            fragment_id=fragment_id,
            have_version=have_version,
            wait_for_version=wait_for_version,
            wait_timeout_s=wait_timeout_s,
            slice_index=slice_of[0],
            slice_count=slice_of[1],
        )
        self.traffic.count(fragment_id, sent=request.ByteSize())
        stream = self._stub.PullParams(
            request, timeout=wait_timeout_s + UNARY_TIMEOUT_S * 4, metadata=self._metadata
        )
        header: pb.PullHeader | None = None
        payload = bytearray()
        for msg in stream:
            self.traffic.count(fragment_id, received=msg.ByteSize())
            if msg.HasField("header"):
                header = msg.header
            else:
                payload += msg.chunk
        if header is None:
            raise RuntimeError("PullParams answered without a header")
        if len(payload) != header.payload_bytes:
            raise RuntimeError(
                f"PullParams sent {len(payload)} bytes, header announced {header.payload_bytes}"
            )
        return header, bytes(payload)

    def heartbeat(
        self, request: pb.HeartbeatRequest, timeout_s: float = UNARY_TIMEOUT_S
    ) -> pb.HeartbeatResponse:
        return self._unary(self._stub.Heartbeat, request, timeout_s)

    def describe_shards(
        self, timeout_s: float = UNARY_TIMEOUT_S, wait_for_ready: bool = False
    ) -> pb.DescribeShardsResponse:
        """The server's place in the shard map, and where the other shards are;
        `wait_for_ready`: wait up to `timeout_s` for the channel to connect, rather than
        fail at once while it cannot."""
        request = pb.DescribeShardsRequest()
        return self._unary(self._stub.DescribeShards, request, timeout_s, wait_for_ready)

    def status(self) -> pb.StatusResponse:
        """What the server sees now (diloco-status)."""
        return self._unary(self._stub.Status, pb.StatusRequest())

    def leave(self, session_id: str) -> None:
        self._unary(self._stub.Leave, pb.LeaveRequest(session_id=session_id))

    def _unary(
        self, method, request, timeout_s: float = UNARY_TIMEOUT_S, wait_for_ready: bool = False
    ):
        response = method(
            request, timeout=timeout_s, metadata=self._metadata, wait_for_ready=wait_for_ready
        )
        self.traffic.count(sent=request.ByteSize(), received=response.ByteSize())
        return response
