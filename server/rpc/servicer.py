"""The gRPC servicer: decode the request, call the Aggregator, encode the answer.

Domain errors (common.errors) become gRPC statuses here and nowhere else. Every message in
and out is counted in `traffic`, per fragment. A push's payload is received into a budgeted
buffer (receive.py), parsed and checked in its wire encoding outside the aggregator's lock
(server/rounds/ingest.py), then handed to the Aggregator. A pull long-polls for its version,
then streams the answer's shared parts. A shard also tells about itself: its place in the
shard map (DescribeShards) and what it sees now (Status, for `diloco-status`).
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Iterator

from common.codec.fragment import chunks, max_fragment_bytes
from common.codec.slices import SliceCut, is_sliced
from common.codec.tensor import decode_values, parse_fragment_view
from common.cpus import usable_cpus
from common.errors import DilocoError, InvalidArgument, PermissionDenied, ResourceExhausted
from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.generated.diloco.v1 import aggregator_pb2_grpc as pb_grpc
from common.rpc import RETRY_AFTER_HEADER
from common.tracing import span
from common.traffic import NO_FRAGMENT, Traffic
from server.aggregator import Aggregator
from server.rounds.ingest import IngestSlots
from server.rounds.slices import HeldSlices, push_slice
from server.rpc.calls import authenticated_learner, current_call
from server.rpc.metrics import Counts, MergedTokens
from server.rpc.receive import BudgetExhausted, PushBudget, receive_into, wire_bytes
from server.state.params import ParamSpec

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
            call = current_call()
            if call is not None:
                call.abort_if_ended()  # asked to end (a revoked token): that is the status
            if method.__name__ == "PushFragment" and isinstance(err, BudgetExhausted):
                context.set_trailing_metadata(((RETRY_AFTER_HEADER, str(PUSH_RETRY_AFTER_MS)),))
            context.abort(err.code, str(err))

    return wrapper


class AggregatorServicer(pb_grpc.AggregatorServicer):
    def __init__(
        self, aggregator: Aggregator, ingest_slots: int = 0, push_budget: PushBudget | None = None
    ) -> None:
        self.aggregator = aggregator
        self.traffic = Traffic()
        self.merged_tokens = MergedTokens()
        # "accepted" or the rejection's status code name (a bounded set), and the long-polls
        # waiting now ("pulls"): for metrics.
        self.push_results, self.waiting = Counts(), Counts()
        # Two per usable core: one push can be received while another is decoded.
        self._ingest = IngestSlots(ingest_slots or 2 * usable_cpus())
        # Push payloads are received into buffers reserved from this (receive.py).
        self.push_budget = push_budget or PushBudget(None, 0.0)
        self.held_slices = HeldSlices()  # sharded islands' pushes, until every slice is here

    def count_push(self, result: str) -> None:
        self.push_results.add(result)

    def _wait_for_version(self, request: pb.PullParamsRequest, context) -> None:
        """Long-poll for the asked version; returns early when the client goes away (cancels,
        disconnects or reaches its deadline) or the call is asked to end (calls.py), so that
        the worker thread is freed at once."""
        asked = request.wait_timeout_s
        wait_s = min(max(asked, 0.0), MAX_PULL_WAIT_S) if math.isfinite(asked) else 0.0
        call = current_call()
        if call is not None:
            call.on_end(self.aggregator.wake)
        ended = lambda: call is not None and call.reason is not None  # noqa: E731
        self.waiting.add("pulls")
        try:
            # The callback wakes the waiters when the call ends; False: it has ended already.
            if context.add_callback(self.aggregator.wake):
                self.aggregator.wait_for_version(
                    request.fragment_id,
                    request.wait_for_version,
                    wait_s,
                    gone=lambda: not context.is_active() or ended(),
                )
        finally:
            self.waiting.add("pulls", -1)
        if call is not None:
            call.abort_if_ended()

    def _check_caller(self, session_id: str = "", learner_id: str = "") -> None:
        """With authentication on, a learner may act only as itself (auth.py)."""
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
        with span("diloco.push") as traced:
            try:
                response = self._push(request_iterator, context, traced)
            except DilocoError as err:
                traced.set_attribute("result", err.code.name)  # as a client sees it
                raise
            traced.set_attribute("result", "slice_held" if response.slices_pending else "accepted")
            return response

    def _push(self, request_iterator, context, traced) -> pb.PushFragmentResponse:
        first = next(request_iterator, None)  # chunks are views (receive.py ChunkViews)
        if not isinstance(first, pb.PushFragmentRequest) or not first.HasField("header"):
            raise InvalidArgument("a push must start with a header message")
        header = first.header
        fid = header.fragment_id
        if traced.is_recording():  # a refused push is traced with who sent what, too
            who = self.aggregator.learner_of(header.session_id)
            size, base = header.payload_bytes, header.base_version
            traced.set_attributes(dict(learner=who, fragment=fid, base_version=base, bytes=size))
        self._check_caller(session_id=header.session_id)
        self.traffic.count(self._traffic_key(fid), received=first.ByteSize())
        agg = self.aggregator
        if header.kind not in (pb.PUSH_KIND_DELTA, pb.PUSH_KIND_INITIAL):
            raise InvalidArgument(f"unknown push kind {header.kind}")
        initial = header.kind == pb.PUSH_KIND_INITIAL
        # Refuse stale, duplicate or unknown pushes before reading their payload.
        shapes = agg.check_push(header.session_id, fid, header.base_version, initial)
        cut = None
        if is_sliced(header.slice_count):  # a rank of a sharded island: its slice alone
            cut = SliceCut(shapes, header.slice_index, header.slice_count)
        # Bound the buffer by what the fragment can take in its largest codec (fp32).
        limit = max_fragment_bytes(shapes if cut is None else cut.shapes, pb.CODEC_FP32)
        if header.payload_bytes > limit:
            raise ResourceExhausted(
                f"announced payload of {header.payload_bytes} bytes exceeds the limit of {limit}"
            )
        pieces = (self._chunk_of(msg, fid) for msg in request_iterator)
        # The announced size is reserved before a byte is buffered, and the payload received
        # before an ingest slot is taken: a learner on a slow link (or one that trickles on
        # purpose) must not hold up the others' pushes while its bytes arrive.
        call = current_call()
        gone = lambda: not context.is_active() or (call is not None and call.reason is not None)  # noqa: E731
        self.push_budget.fit(agg.owned_shapes)  # the model is known once a push is checked
        with self.push_budget.reserve(header.payload_bytes, gone, initial=initial) as buffer:
            payload = receive_into(buffer, pieces)
            # A slot bounds how many payloads are decoded and added at once; a push is added
            # to the round's sum straight from the buffer, in its wire encoding, without a
            # float32 copy of its own (server/rounds/ingest.py).
            with self._ingest.take() as slot:
                if cut is not None:
                    version = push_slice(agg, self.held_slices, header, shapes, cut, payload, slot)
                    if version is not None:
                        self.merged_tokens.add(fid, version, header.tokens, agg.version(fid))
                elif initial:
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
        pending = version is None  # a slice whose island's other slices are still due
        response = pb.PushFragmentResponse(
            accepted=True,
            round_version=header.base_version if pending else version,
            slices_pending=pending,
        )
        self.count_push("slice_held" if pending else "accepted")
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
        result = agg.pull(
            request.session_id,
            fid,
            request.have_version,
            (request.slice_index, request.slice_count),
        )
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
        return _describe_shards(self.aggregator)

    @_abort_on_domain_error
    def Status(self, request: pb.StatusRequest, context) -> pb.StatusResponse:
        return _shard_status(self.aggregator)

    def _traffic_key(self, fragment_id: int) -> int:
        """The fragment to count bytes under; unknown ids share one key (bounded labels)."""
        return fragment_id if self.aggregator.has_fragment(fragment_id) else NO_FRAGMENT

    def _chunk_of(self, msg: pb.PushFragmentRequest | memoryview, fragment_id: int):
        if not isinstance(msg, memoryview) and not msg.HasField("chunk"):
            raise InvalidArgument("only payload chunks may follow the push header")
        self.traffic.count(fragment_id, received=wire_bytes(msg))
        # A view is a chunk, as receive.py's ChunkViews reads them.
        return msg if isinstance(msg, memoryview) else msg.chunk

    def _stream(
        self, header: pb.PullHeader, parts: tuple[bytes, ...]
    ) -> Iterator[pb.PullParamsResponse]:
        """The header, then the payload's parts in chunks of at most PULL_CHUNK_BYTES. The parts
        are shared between pulls (server/state/fragment.py) and never joined here: a stream holds
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


def _describe_shards(aggregator: Aggregator) -> pb.DescribeShardsResponse:
    """This shard's index, the count, the advertised addresses and (once a learner joined)
    the map id and owners."""
    sharding = aggregator.config.sharding
    shard_map, _ = aggregator.owned()
    response = pb.DescribeShardsResponse(
        shard_index=sharding.shard_index,
        shard_count=sharding.shard_count,
        addresses=sharding.addresses(),
        fragments=aggregator.config.streaming.fragments,
    )
    if shard_map is not None:
        response.map_id = shard_map.map_id
        response.fingerprint_hash = shard_map.fingerprint_hash
        response.fragment_owners.extend(shard_map.owners)
    return response


def _shard_status(aggregator: Aggregator) -> pb.StatusResponse:
    """Live learners, the owned fragments' versions, outer steps taken, last pushes."""
    sharding = aggregator.config.sharding
    shard_map, owned = aggregator.owned(crc=True)
    fragments = [
        pb.FragmentStatus(
            fragment_id=fid, version=version, owner=sharding.shard_index, params_crc32=crc
        )
        for fid, version, crc in owned
    ]
    learners = [
        pb.LearnerStatus(
            learner_id=row.learner_id,
            live=row.live,
            last_push_fragment=row.last_push_fragment,
            last_push_version=row.last_push_version,
            last_push_age_s=row.last_push_s_ago,
        )
        for row in aggregator.learner_rows()
    ]
    return pb.StatusResponse(
        shard_index=sharding.shard_index,
        shard_count=sharding.shard_count,
        map_id=shard_map.map_id if shard_map is not None else "",
        mode=aggregator.config.rounds.mode,
        fragments=fragments,
        rounds_closed=sum(max(0, f.version) for f in fragments),
        learners=learners,
        setting_changes=[
            pb.SettingChange(setting=name, was=json.dumps(was), now=json.dumps(now))
            for name, was, now in aggregator.setting_changes
        ],
    )
