"""One learner's membership in a run: join, the fragment schedule, rejoin, resume, leave.

    session = SyncSession(config, params, fingerprint, progress, tokens_per_step=B * T)
    session.open(stop)               # connect and join: the local params become the global ones
    while training:
        ...one inner step...
        session.after_inner_step()   # rejoin a shard that lost the session; push / merge
    session.drain(); session.close()

The first learner to join hands the server its initial parameters; every learner then starts
from the server's copy, so all replicas begin identical. DilocoSync (learner/api.py), which
the built-in job drives too, goes through this class. A session opened with `resume`
(replicas saved in a checkpoint, learner/checkpoint.py) pulls only the updates since the
saved versions and keeps its local parameters for every fragment the run has not moved
meanwhile (learner/replicas.py). Heartbeats and the pace they steer are learner/heartbeat.py's.
A server that lost the session (restarted, or the lease ran out) is a shard that lost it,
with one shard as with N: the client notes it where NOT_FOUND or a new epoch is read
(learner/shard_sessions.py), and the shard is joined again alone (learner/rejoin.py), the
local parameters kept for every fragment the server has not moved.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import grpc
import torch

from common.codec.fragment import params_crc32
from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.retry import Stopped, call_with_retry
from learner.config import DilocoSyncConfig
from learner.connection import connect
from learner.heartbeat import Heartbeat, Membership, Pacer
from learner.progress import Progress, SavedReplica
from learner.rejoin import ShardRejoins
from learner.replicas import ReplicaLoader
from learner.sliced import ShardedIsland
from learner.streaming import Schedule, StreamingSync, merge
from learner.transport import GrpcTransport

log = logging.getLogger("diloco.learner")


class SyncSession:
    """Talks to the aggregator for one learner; the training loop stays the caller's."""

    def __init__(
        self,
        config: DilocoSyncConfig,
        params: Sequence[torch.Tensor],
        fingerprint: Sequence[pb.ParamSpec],
        progress: Progress,
        tokens_per_step: int,
        island: ShardedIsland | None = None,
    ) -> None:
        """`island`: this process is one rank of a sharded island and `params` are its
        slices (learner/sliced.py); `tokens_per_step` is then the island's."""
        self.config = config
        self.island = island
        self.learner_id = config.connection.learner_id
        self.params = params
        self.fingerprint = list(fingerprint)
        self.progress = progress
        self.tokens_per_step = tokens_per_step
        self.client = connect(config.connection)
        self.transport = GrpcTransport(self.client, lambda: self.membership.session_id)
        if island is not None:
            self.transport.slice_of, self.transport.carries = island.slice_of, island.carries
        self.replicas = ReplicaLoader(
            self.client,
            self.transport,
            self.params,
            self.learner_id,
            [tuple(spec.shape) for spec in self.fingerprint],
            self.transport.slice_of,
            self.transport.carries,
        )
        self.sync: StreamingSync | None = None
        self.step = 0  # the schedule step, shared in phase by all learners (Schedule.resume_step)
        self.pacer = Pacer(config.sync)
        self.resume: list[SavedReplica] | None = None  # set before open() to resume
        self.heartbeat = Heartbeat(
            self.client,
            self.learner_id,
            progress,
            self.pacer,
            lambda: self.membership,
            lambda: self.step,
        )
        self.shard_rejoins = ShardRejoins(self)

    @property
    def membership(self) -> Membership:
        """The session as last joined (the client's: it changes at a shard's rejoin too)."""
        return self.client.membership()

    def open(self, stop: threading.Event) -> None:
        """Connect, join (pulling the global parameters) and start heartbeats.

        A join that no shard answers (a restart, a network cut: UNAVAILABLE) is tried again
        with backoff for up to connect_timeout_s; there is nothing to train on before the
        first one succeeds. Later, a shard that lost the session is joined again alone
        (ShardRejoins) while training goes on.
        """
        self.transport.stop_requested = stop
        timeout_s = self.config.connection.connect_timeout_s
        deadline = time.monotonic() + timeout_s
        self.client.wait_ready(timeout_s)

        def give_up(err: grpc.RpcError, delay_s: float) -> None:
            if time.monotonic() >= deadline:
                raise err

        what = f"learner={self.learner_id} join at {self.client.target}"
        try:
            call_with_retry(lambda: self._join(self.resume), stop, give_up, what=what)
        except Stopped as stopped:
            # Asked to stop while the server is away: end with the server's error.
            raise stopped.__cause__ from None
        if self.island is None or self.island.is_leader:
            self.heartbeat.start()  # the island's leader keeps the lease of its session

    def after_inner_step(self) -> bool:
        """Advance the schedule by one inner step: rejoin the shards that lost the session,
        then push and merge what the schedule says (a lost shard's fragments: neither).

        Returns True if the local parameters changed (a merge, or a rejoin that took the
        server's values). Raises Stopped if asked to stop while waiting at a merge.
        """
        if self.sync is None:
            raise RuntimeError("after_inner_step() before the session joined")
        changed = self.island is None and self.shard_rejoins.try_rejoin()
        advance = self.pacer.steps(self.progress)
        if self.island is not None and not self.pacer.blocking:
            advance = self.island.leader_value(advance)  # the pace its heartbeats steer
        for _ in range(advance):
            self.step += 1
            self.sync.push_phase(self.step, self.progress.inner_steps)
            changed |= bool(self.sync.merge_phase(self.step))
        if advance == 0:  # an extra inner step before the next push; merge what arrived
            changed |= bool(self.sync.merge_phase(self.step))
        self._count_blocked()
        return changed

    def drain(self) -> None:
        """Merge the syncs still in flight after the last step, then take the global values.

        Ends with every local parameter equal to the newest server version this learner saw
        (a shard still away at the end keeps its fragments' local values). A sync whose
        shard restarted meanwhile ends with nothing to merge (its push was never applied);
        that shard is joined again first, and its fragments end at its restored versions.
        """
        if self.sync is None:
            raise RuntimeError("drain() before the session joined")
        self.sync.blocking = True  # the run is over: waiting costs no training
        self.sync.merge_phase(self.step + self.config.sync.overlap_steps)
        self._count_blocked()
        if self.island is not None:  # its merges checked that every rank is joined
            self.sync.load_globals()
            return
        self.shard_rejoins.try_rejoin(now=True)
        self.sync.load_globals(keep=self.client.away())

    def close(self) -> None:
        """Stop heartbeats and syncs, leave the run, and record the totals in `progress`."""
        self.heartbeat.stop()
        self.transport.close()
        self._leave()
        self._finish_progress()
        self.client.close()

    def saved_replicas(self) -> list[SavedReplica]:
        """Copies of the global fragments this learner holds, for a checkpoint."""
        replicas = self.sync.replicas if self.sync is not None else []
        return [
            SavedReplica(r.fragment_id, list(r.indices), r.version, [p.clone() for p in r.params])
            for r in replicas
        ]

    # -- protocol steps --------------------------------------------------------------------

    def _join(self, resume: list[SavedReplica] | None = None) -> None:
        """Join every shard (open's one join) and load the replicas it brings."""
        cfg = self.config.sync
        # The tokens of one step, declared: the server refuses pushes that claim more.
        # The client then holds the new membership, replaced whole (ShardSessions).
        if self.island is None:
            reply = self._join_shards()
        else:  # the leader joins; every rank takes its session
            reply = self.island.share_join(self.client, self._join_shards, self.learner_id)
        if self.island is None or self.island.is_leader:
            log.info(
                "learner=%s joined epoch=%d mode=%s fragments=%d layout=%s%s",
                self.learner_id,
                reply.server_epoch,
                reply.mode,
                len(reply.fragments),
                reply.layout,
                self.island.describe() if self.island else "",
            )
        # Fragments whose shard did not answer come in when it does (ShardRejoins).
        away = self.client.away()
        replicas, kept = self.replicas.load(reply.session_id, reply.fragments, resume, away)
        if self.island is not None:  # one version per fragment; kept only where all kept
            kept = self.island.settle_joined(replicas, kept, self.transport.pull)
        schedule = Schedule(cfg.sync_every_steps, len(replicas), cfg.overlap_steps)
        blocking = self.pacer.blocking = reply.mode == "sync"  # quorum, async: never wait
        if not blocking and reply.schedule_step > 0:
            # Rounds may close more than once per H steps here: start where the others are.
            self.step = reply.schedule_step
        else:
            self.step = schedule.resume_step([r.version for r in replicas])
        self.sync = StreamingSync(
            self.params,
            replicas,
            schedule,
            self.transport,
            cfg.push_codec,
            cfg.merge_alpha,
            tokens_per_step=self.tokens_per_step,
            blocking=blocking,
            start_step=self.progress.inner_steps,  # push_phase counts inner steps
            push_topk_fraction=cfg.push_topk_fraction,
            push_feedback_decay=cfg.push_feedback_decay,
            push_feedback_in_model=cfg.push_feedback_in_model,
            away=self.client.away,
            island=self.island,
        )
        # The run's total, so that a resumed learner's goes on from its checkpoint's.
        self.sync.stats.blocked_s = self.progress.blocked_on_sync_s
        for replica in replicas:
            if replica.fragment_id not in kept:
                merge(self.sync.local(replica), replica.params, alpha=0.0)
        if resume is not None:
            log.info(
                "learner=%s resumed versions=%s kept_local=%s pulled_bytes=%d",
                self.learner_id,
                [r.version for r in replicas],
                sorted(kept),
                self.client.traffic.received,
            )

    def _join_shards(self) -> pb.JoinResponse:
        return self.client.join(self.learner_id, self.fingerprint, self.tokens_per_step)

    def _leave(self) -> None:
        session_id = self.membership.session_id
        if not session_id or (self.island is not None and not self.island.is_leader):
            return
        try:
            self.client.leave(session_id)
        except grpc.RpcError as err:
            log.warning("learner=%s leave failed: %s", self.learner_id, err.code().name)

    def _count_blocked(self) -> None:
        """Keep `progress` current with the time the loop waited at merges."""
        if self.sync is not None:
            self.progress.blocked_on_sync_s = self.sync.stats.blocked_s

    def _finish_progress(self) -> None:
        p, traffic = self.progress, self.client.traffic
        p.bytes_sent, p.bytes_received = traffic.sent, traffic.received
        p.bytes_by_fragment = traffic.by_fragment()
        p.stale_pushes = self.transport.stale_pushes
        if self.sync is not None:
            p.versions = [r.version for r in self.sync.replicas]
            p.params_crc32 = [params_crc32(r.params) for r in self.sync.replicas]
            self._count_blocked()
            p.fragment_syncs = self.sync.stats.syncs
            p.late_merges = self.sync.stats.late_merges
            p.skipped_pushes = self.sync.stats.skipped_pushes
