"""The gRPC servicer: decode the request, call the Aggregator, encode the answer.

Domain errors (common.errors) become gRPC statuses here and nowhere else. Every message in
and out is counted in `traffic`, per fragment.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import threading
from collections.abc import Callable, Iterator

from common.codec.fragment import chunks, max_fragment_bytes
from common.codec.tensor import decode_values, parse_fragment_view
from common.cpus import usable_cpus
from common.errors import DilocoError, InvalidArgument, PermissionDenied, ResourceExhausted
from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.generated.diloco.v1 import aggregator_pb2_grpc as pb_grpc
from common.rpc import RETRY_AFTER_HEADER
from common.traffic import NO_FRAGMENT, Traffic
from server.aggregator import Aggregator
from server.auth import authenticated_learner
from server.global_params import ParamSpec
from server.ingest import IngestSlots
from server.push_wire import wire_bytes
from server.receive import BudgetExhausted, PushBudget, receive_into
from server.status import PushLog, describe_shards, shard_status

log = logging.getLogger(__name__)

# The longest a PullParams call may block waiting for a new version.
MAX_PULL_WAIT_S = 60.0
# A push refused for want of push memory is told to retry after this long.
PUSH_RETRY_AFTER_MS = 1000
# Pull payload parts below this size (framing) are joined with their neighbours (_pieces).
SMALL_PART_BYTES = 4096
# Pull answers are streamed in messages of at most this size. Each stream in flight holds
# about three copies of one message (its slice, the message, its serialization, gRPC's send
# buffer), so this, not the model, sets what a pulling learner costs the server.
PULL_CHUNK_BYTES = 256 << 10


def _abort_on_domain_error(method):
    """Map DilocoError to its status code; for streaming responses too."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except DilocoError as err:
            # The message, not the exception: a handler that keeps log records (a test's
            # capture, a memory handler) would keep its traceback, and with it the call and
            # its HTTP/2 stream, which then counts against max_concurrent_streams.
            log.warning("%s rejected: %s", method.__name__, str(err))
            if method.__name__ == "PushFragment":
                self.count_push(err.code.name.lower())
                if isinstance(err, BudgetExhausted):
                    context.set_trailing_metadata(((RETRY_AFTER_HEADER, str(PUSH_RETRY_AFTER_MS)),))
            context.abort(err.code, str(err))

    return wrapper


class MergedTokens:
    """Tokens of accepted pushes whose round has closed, per fragment: the training that
    reached the global model (for metrics). A push counts once the version it was accepted
    for exists; one in a round that a crash loses never does."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._merged: collections.Counter[int] = collections.Counter()
        # fragment -> round version -> tokens of its accepted pushes, while the round is open
        self._open: dict[int, collections.Counter[int]] = {}

    def add(self, fragment_id: int, round_version: int, tokens: int, version: int) -> None:
        """A push of `tokens` accepted for `round_version`; the fragment is at `version`."""
        with self._lock:
            self._open.setdefault(fragment_id, collections.Counter())[round_version] += tokens
            self._close(fragment_id, version)

    def totals(self, version_of: Callable[[int], int]) -> dict[int, int]:
        """Merged tokens per fragment, given each fragment's current version."""
        with self._lock:
            for fragment_id in self._open:
                self._close(fragment_id, version_of(fragment_id))
            return dict(self._merged)

    def _close(self, fragment_id: int, version: int) -> None:
        rounds = self._open[fragment_id]
        for round_version in [v for v in rounds if v <= version]:
            self._merged[fragment_id] += rounds.pop(round_version)


class AggregatorServicer(pb_grpc.AggregatorServicer):
    def __init__(
        self, aggregator: Aggregator, ingest_slots: int = 0, push_budget: PushBudget | None = None
    ) -> None:
        self.aggregator = aggregator
        self.traffic = Traffic()
        self.merged_tokens = MergedTokens()
        # "accepted" or the rejection's status code name (a bounded set): for metrics.
        self.push_results: collections.Counter[str] = collections.Counter()
        self.pushes = PushLog()  # each learner's last accepted push (Status)
        # Two per usable core: one push can be received while another is decoded.
        self._ingest = IngestSlots(ingest_slots or 2 * usable_cpus())
        # Push payloads are received into buffers reserved from this (server/receive.py).
        self.push_budget = push_budget or PushBudget(None, 0.0)
        self._push_results_lock = threading.Lock()
        # Long-polls waiting now (for metrics): a client that goes away ends its wait.
        self._waiting_pulls = 0
        self._waiting_lock = threading.Lock()

    def count_push(self, result: str) -> None:
        with self._push_results_lock:
            self.push_results[result] += 1

    def push_result_counts(self) -> dict[str, int]:
        with self._push_results_lock:
            return dict(self.push_results)

    def waiting_pulls(self) -> int:
        """PullParams calls blocked now waiting for a version."""
        with self._waiting_lock:
            return self._waiting_pulls

    def _wait_for_version(self, request: pb.PullParamsRequest, context) -> None:
        """Long-poll for the asked version; returns early when the client goes away (cancels,
        disconnects or reaches its deadline), so that the worker thread is freed at once."""
        asked = request.wait_timeout_s
        wait_s = min(max(asked, 0.0), MAX_PULL_WAIT_S) if math.isfinite(asked) else 0.0
        with self._waiting_lock:
            self._waiting_pulls += 1
        try:
            # The callback wakes the waiters when the call ends; False: it has ended already.
            if context.add_callback(self.aggregator.wake):
                self.aggregator.wait_for_version(
                    request.fragment_id,
                    request.wait_for_version,
                    wait_s,
                    gone=lambda: not context.is_active(),
                )
        finally:
            with self._waiting_lock:
                self._waiting_pulls -= 1

    def _check_caller(self, session_id: str = "", learner_id: str = "") -> None:
        """With authentication on, a learner may act only as itself (server/auth.py)."""
        caller = authenticated_learner()
        if caller is None:
            return
        owner = learner_id or self.aggregator.session_learner(session_id)
        if owner != caller:
            raise PermissionDenied(f"learner {caller} may not act as learner {owner}")

    @_abort_on_domain_error
    def Join(self, request: pb.JoinRequest, context) -> pb.JoinResponse:
        self._check_caller(learner_id=request.learner_id or "(empty)")
        fingerprint = [ParamSpec(p.name, tuple(p.shape), p.dtype) for p in request.fingerprint]
        result = self.aggregator.join(request.learner_id, fingerprint, request.tokens_per_step)
        response = pb.JoinResponse(
            session_id=result.session_id,
            server_epoch=result.server_epoch,
            fragments=[
                pb.FragmentLayout(fragment_id=fid, param_indices=indices, version=version)
                for fid, indices, version in result.fragments
            ],
            lease_s=result.lease_s,
            mode=result.mode,
            layout=result.layout,
            schedule_step=result.schedule_step,
        )
        if result.shard_map is not None:
            shard_map = result.shard_map
            response.shard_index, response.shard_count = (
                shard_map.shard_index,
                shard_map.shard_count,
            )
            response.map_id = shard_map.map_id
            response.fragment_owners.extend(shard_map.owners)
        self.traffic.count(received=request.ByteSize(), sent=response.ByteSize())
        return response

    @_abort_on_domain_error
    def PushFragment(self, request_iterator: Iterator[pb.PushFragmentRequest], context):
        first = next(request_iterator, None)  # chunks are views (server/push_wire.py)
        if not isinstance(first, pb.PushFragmentRequest) or not first.HasField("header"):
            raise InvalidArgument("a push must start with a header message")
        header = first.header
        fid = header.fragment_id
        self._check_caller(session_id=header.session_id)
        self.traffic.count(self._traffic_key(fid), received=first.ByteSize())
        agg = self.aggregator
        if header.kind not in (pb.PUSH_KIND_DELTA, pb.PUSH_KIND_INITIAL):
            raise InvalidArgument(f"unknown push kind {header.kind}")
        initial = header.kind == pb.PUSH_KIND_INITIAL
        # Refuse stale, duplicate or unknown pushes before reading their payload.
        shapes = agg.check_push(header.session_id, fid, header.base_version, initial)
        # Looked up now: once the push is counted, a lease that ran out meanwhile must not
        # turn its answer into NOT_FOUND.
        learner_id = agg.session_learner(header.session_id)
        # Bound the buffer by what the fragment can take in its largest codec (fp32).
        limit = max_fragment_bytes(shapes, pb.CODEC_FP32)
        if header.payload_bytes > limit:
            raise ResourceExhausted(
                f"announced payload of {header.payload_bytes} bytes exceeds the limit of {limit}"
            )
        pieces = (self._chunk_of(msg, fid) for msg in request_iterator)
        # The announced size is reserved before a byte is buffered, and the payload received
        # before an ingest slot is taken: a learner on a slow link (or one that trickles on
        # purpose) must not hold up the others' pushes while its bytes arrive.
        gone = lambda: not context.is_active()  # noqa: E731
        self.push_budget.fit(agg.owned_shapes)  # the model is known once a push is checked
        with self.push_budget.reserve(header.payload_bytes, gone, initial=initial) as buffer:
            payload = receive_into(buffer, pieces)
            # A slot bounds how many payloads are decoded and added at once; a push is added
            # to the round's sum straight from the buffer, in its wire encoding, without a
            # float32 copy of its own (server/ingest.py).
            with self._ingest.take() as slot:
                if initial:
                    tensors = [decode_values(t) for t in parse_fragment_view(payload, shapes)]
                    version = agg.initialize(header.session_id, fid, tensors)
                else:
                    version = agg.push(
                        header.session_id,
                        fid,
                        header.base_version,
                        slot.parse(payload, shapes, hold=lambda: self.push_budget.hold(payload)),
                        tokens=header.tokens,
                        inner_steps=header.inner_steps,
                    )
                    self.merged_tokens.add(fid, version, header.tokens, agg.version(fid))
                    self.pushes.record(learner_id, fid, version)
        response = pb.PushFragmentResponse(accepted=True, round_version=version)
        self.count_push("accepted")
        self.traffic.count(fid, sent=response.ByteSize())
        return response

    @_abort_on_domain_error
    def PullParams(self, request: pb.PullParamsRequest, context):
        agg, fid = self.aggregator, request.fragment_id
        self.traffic.count(self._traffic_key(fid), received=request.ByteSize())
        self._check_caller(session_id=request.session_id)
        # Authenticates the session and renews its lease; heartbeat() would also overwrite the
        # learner's reported progress (step, tokens, loss) with defaults.
        agg.session_learner(request.session_id)
        if request.wait_for_version > agg.version(fid):
            self._wait_for_version(request, context)
            if not context.is_active():
                return iter(())  # nobody to answer
        result = agg.pull(request.session_id, fid, request.have_version)
        header = pb.PullHeader(
            fragment_id=fid,
            version=result.version,
            kind=result.kind,
            payload_bytes=result.payload_bytes,
            params_crc32=result.params_crc32,
        )
        return self._stream(header, result.parts)

    @_abort_on_domain_error
    def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        self._check_caller(session_id=request.session_id)
        versions, live = self.aggregator.heartbeat(
            request.session_id,
            request.step,
            request.tokens,
            request.loss,
            request.step_time_s,
            request.schedule_step,
        )
        response = pb.HeartbeatResponse(
            server_epoch=self.aggregator.server_epoch,
            fragment_versions=versions,
            live_learners=live,
            median_step_time_s=self.aggregator.median_step_time_s(),
            schedule_step=self.aggregator.schedule_estimate(),
        )
        self.traffic.count(received=request.ByteSize(), sent=response.ByteSize())
        return response

    @_abort_on_domain_error
    def Leave(self, request: pb.LeaveRequest, context) -> pb.LeaveResponse:
        self._check_caller(session_id=request.session_id)
        self.aggregator.leave(request.session_id)
        self.traffic.count(received=request.ByteSize())
        return pb.LeaveResponse()

    @_abort_on_domain_error
    def DescribeShards(self, request: pb.DescribeShardsRequest, context):
        return describe_shards(self.aggregator)

    @_abort_on_domain_error
    def Status(self, request: pb.StatusRequest, context) -> pb.StatusResponse:
        return shard_status(self.aggregator, self.pushes)

    def _traffic_key(self, fragment_id: int) -> int:
        """The fragment to count bytes under; unknown ids share one key (bounded labels)."""
        return fragment_id if self.aggregator.has_fragment(fragment_id) else NO_FRAGMENT

    def _chunk_of(self, msg: pb.PushFragmentRequest | memoryview, fragment_id: int):
        if not isinstance(msg, memoryview) and not msg.HasField("chunk"):
            raise InvalidArgument("only payload chunks may follow the push header")
        self.traffic.count(fragment_id, received=wire_bytes(msg))
        # A view is a chunk, as server/push_wire.py reads them.
        return msg if isinstance(msg, memoryview) else msg.chunk

    def _stream(
        self, header: pb.PullHeader, parts: tuple[bytes, ...]
    ) -> Iterator[pb.PullParamsResponse]:
        """The header, then the payload's parts in chunks of at most PULL_CHUNK_BYTES. The parts
        are shared between pulls (server/fragment.py) and never joined here: a stream holds
        one chunk at a time, whatever the model's size. Consecutive small parts (a chain's
        framing) go together in one message; the learner joins the chunks in order."""
        first = pb.PullParamsResponse(header=header)
        self.traffic.count(header.fragment_id, sent=first.ByteSize())
        yield first
        for piece in _pieces(parts, PULL_CHUNK_BYTES):
            msg = pb.PullParamsResponse(chunk=piece)
            self.traffic.count(header.fragment_id, sent=msg.ByteSize())
            yield msg


def _pieces(parts: tuple[bytes, ...], size: int) -> Iterator[bytes]:
    """The parts' bytes, in order, in pieces of at most `size`: a part of at least
    SMALL_PART_BYTES is cut by itself (a part that fits is sent as is, uncopied); smaller
    ones are joined with their small neighbours."""
    small: list[bytes] = []
    small_bytes = 0
    for part in parts:
        if len(part) < min(SMALL_PART_BYTES, size):
            if small_bytes + len(part) > size:
                yield b"".join(small)
                small, small_bytes = [], 0
            small.append(part)
            small_bytes += len(part)
            continue
        if small:
            yield b"".join(small)
            small, small_bytes = [], 0
        yield from chunks(part, size)
    if small:
        yield b"".join(small)
