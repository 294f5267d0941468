"""Fragment syncs over gRPC on a background thread, so training continues while they travel.

One worker thread per shard (learner/shards.py) runs that shard's syncs in the order they
were started: push the pseudo-gradient, then long-poll PullParams until the round it joined
has closed. A shard that is down stalls only its own fragments' syncs. The training loop
collects the result at the merge point (StreamingSync.merge_phase) and only waits if it is
not back yet. A sync whose shard no longer knows its session (SessionLost: the shard was
noted lost where NOT_FOUND is read, learner/shard_sessions.py) ends with nothing to merge
(None), and the learner joins that shard alone again (learner/rejoin.py); a plain server is
shard 0 of 1.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import grpc

from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.retry import Stopped, call_with_retry
from learner.shard_sessions import SessionLost
from learner.shards import ShardedClient
from learner.streaming import PullReply

log = logging.getLogger("diloco.learner")

PULL_WAIT_S = 20.0


class GrpcTransport:
    """Runs syncs in order on one thread, retrying while the server is unreachable.

    A retry keeps the learner's session and base version; if the shard came back without
    the session (restarted), the sync ends with None and the shard is joined again
    (ShardRejoins).
    """

    def __init__(self, client: ShardedClient, session_id: Callable[[], str]) -> None:
        """Each shard's syncs (client.shard_of) get a thread of their own."""
        self.client = client
        self.shard_of = client.shard_of
        self.session_id = session_id
        self.stale_pushes = 0
        self.retries = 0
        # Per shard, set to abandon every sync started so far (at a rejoin, or at close): a
        # new event for each generation of syncs.
        self._abandon: dict[int, threading.Event] = {}
        self.stop_requested = threading.Event()  # the learner's stop (Learner.run sets it)
        self._workers: dict[int, ThreadPoolExecutor] = {}  # by shard, made when first used
        # (index, count): a rank of a sharded island pushes and pulls its slice of every
        # fragment (learner/sliced.py); count 0: whole fragments.
        self.slice_of = (0, 0)
        # A push's encoding runs on the shard's sync thread, not the training thread
        # (StreamingSync gives a dense one as a callable: Transport.start_sync).
        self.encodes_in_background = True
        # False for an HSDP rank outside replica 0: it sends nothing, and takes replica 0's
        # merged slice over the island's network.
        self.carries = True

    def start_sync(
        self,
        fragment_id: int,
        base_version: int,
        payload: bytes | Callable[[], bytes],
        tokens: int,
        inner_steps: int,
    ) -> Future[PullReply]:
        if not self.carries:
            done: Future[PullReply] = Future()
            done.set_result(PullReply(pb.PULL_KIND_UP_TO_DATE, base_version, b"", 0))
            return done
        session = self.session_id()  # fixed now: a rejoin later must not adopt this push
        shard = self.shard_of(fragment_id)
        if shard not in self._workers:
            self._workers[shard] = ThreadPoolExecutor(1, thread_name_prefix=f"sync{shard}")
        return self._workers[shard].submit(
            self._sync,
            self._abandon_event(shard),
            session,
            fragment_id,
            base_version,
            payload,
            tokens,
            inner_steps,
        )

    def finish_sync(self, handle: Future[PullReply]) -> PullReply | None:
        """Wait for the sync (None: lost with its shard's session); raises Stopped if the
        learner is asked to stop meanwhile (a learner waiting at a merge must still answer
        SIGTERM)."""
        while True:
            try:
                return handle.result(timeout=0.2)
            except FutureTimeout:
                if self.stop_requested.is_set():
                    raise Stopped() from None
            except SessionLost:
                return None  # its shard is noted lost, and is joined again (ShardRejoins)

    def ready(self, handle: Future[PullReply]) -> bool:
        return handle.done()

    def abandon_in_flight(self, shard: int | None = None) -> None:
        """Drop every sync started so far (their session is gone), or the shard's only; new
        ones run at once."""
        for s in list(self._abandon) if shard is None else [shard]:
            self._abandon.pop(s, threading.Event()).set()

    def close(self) -> None:
        self.abandon_in_flight()
        for worker in self._workers.values():
            worker.shutdown(wait=True, cancel_futures=True)

    def pull(
        self,
        fragment_id: int,
        have_version: int,
        wait_for_version: int,
        session: str = "",
        abandon: threading.Event | None = None,
        retry: bool = True,
    ) -> PullReply:
        """Long-poll until the fragment reaches `wait_for_version`; returns what to apply.

        With retry=False an unreachable server raises at once (the caller backs off).
        """
        session = session or self.session_id()
        abandon = abandon or self._abandon_event(self.shard_of(fragment_id))
        while True:

            def call():
                return self.client.pull(
                    session, fragment_id, have_version, wait_for_version, PULL_WAIT_S, self.slice_of
                )

            header, payload = self._retry(call, abandon, fragment_id, "pull") if retry else call()
            if header.version >= wait_for_version:
                return PullReply(header.kind, header.version, payload, header.params_crc32)

    def _abandon_event(self, shard: int) -> threading.Event:
        return self._abandon.setdefault(shard, threading.Event())

    def _retry(self, call, abandon: threading.Event, fragment_id: int, name: str):
        """`call` (a `name`: push or pull of the fragment) retried while its shard is away."""

        def count(err: grpc.RpcError, delay_s: float) -> None:
            self.retries += 1

        if abandon.is_set():
            raise Stopped()
        shard = self.shard_of(fragment_id)
        what = f"fragment={fragment_id} shard={shard} {name} at {self.client.addresses[shard]}"
        return call_with_retry(call, abandon, count, what=what)

    def _sync(
        self,
        abandon: threading.Event,
        session: str,
        fragment_id: int,
        base_version: int,
        payload: bytes | Callable[[], bytes],
        tokens: int,
        inner_steps: int,
    ) -> PullReply:
        data = payload() if callable(payload) else payload
        reply = self._push_then_pull(
            abandon, session, fragment_id, base_version, data, tokens, inner_steps
        )
        reply.push_bytes = len(data) if callable(payload) else 0
        return reply

    def _push_then_pull(
        self,
        abandon: threading.Event,
        session: str,
        fragment_id: int,
        base_version: int,
        payload: bytes,
        tokens: int,
        inner_steps: int,
    ) -> PullReply:
        header = pb.PushHeader(
            session_id=session,
            fragment_id=fragment_id,
            base_version=base_version,
            tokens=tokens,
            inner_steps=inner_steps,
            kind=pb.PUSH_KIND_DELTA,
            slice_index=self.slice_of[0],
            slice_count=self.slice_of[1],
        )
        try:
            answer = self._retry(
                lambda: self.client.push(header, payload), abandon, fragment_id, "push"
            )
            if answer.slices_pending:
                # The island's other ranks' slices are still due: the rank whose slice
                # completes the set learns how it went, and the island's ranks agree on the
                # version to merge (learner/sliced.py). Nothing to wait for here.
                return PullReply(pb.PULL_KIND_UP_TO_DATE, base_version, b"", 0)
            target = answer.round_version
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.ALREADY_EXISTS:
                # A retry of a push whose first attempt did arrive: it counts once, as it should.
                return self.pull(fragment_id, base_version, base_version + 1, session, abandon)
            if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            # Stale (the round closed without us) or refused by the server's norm guard: this
            # update is lost; take the current state without waiting for a new version, which
            # a round whose every push was refused never produces (server/rounds/policy.py).
            self.stale_pushes += 1
            log.warning("fragment=%d push rejected: %s", fragment_id, err.details())
            target = base_version
        return self.pull(fragment_id, base_version, target, session, abandon)
