"""One learner's membership in a run: join, heartbeats, the fragment schedule, rejoin, leave.

    session = SyncSession(config, params, fingerprint, progress, tokens_per_step=B * T)
    session.open(stop)               # connect and join: the local params become the global ones
    while training:
        ...one inner step...
        session.after_inner_step()   # push / merge what the schedule says, or rejoin
    session.drain(); session.close()

The first learner to join hands the server its initial parameters; every learner then starts
from the server's copy, so all replicas begin identical. The built-in Learner
(learner/trainer.py) and the library API (learner/api.py) both go through this class, so they
speak the protocol the same way. A session opened with `resume` (replicas saved in a
checkpoint, learner/checkpoint.py) pulls only the updates since the saved versions and keeps
its local parameters for every fragment the run has not moved meanwhile.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.retry import Backoff, is_retryable, retry_after_s
from common.rpc import LEARNER_ID_HEADER
from common.tls import channel_credentials
from common.wire import encode_fragment, params_crc32
from learner.client import AggregatorClient
from learner.config import LearnerConfig
from learner.streaming import FragmentReplica, Schedule, StreamingSync, merge
from learner.transport import GrpcTransport

log = logging.getLogger("diloco.learner")

# The server moves the others' reports (up to a heartbeat old) on at their compute speed,
# which runs a step or so ahead of their real one: a smaller error is noise, not drift.
PHASE_DEADBAND = 2


@dataclass
class Progress:
    """What the learner has done so far; the final summary is this as a dict."""

    learner_id: str
    outer_steps: int = 0
    inner_steps: int = 0
    tokens: int = 0
    versions: list[int] = dataclasses.field(default_factory=list)  # per fragment
    eval_losses: list[float] = dataclasses.field(default_factory=list)
    compute_s: float = 0.0
    train_wall_s: float = 0.0  # from the first inner step to the last
    eval_s: float = 0.0  # of that, evaluating: utilisation = compute_s / (train_wall_s - eval_s)
    blocked_on_sync_s: float = 0.0
    fragment_syncs: int = 0
    late_merges: int = 0
    skipped_pushes: int = 0
    rejoins: int = 0
    stale_pushes: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_by_fragment: dict[int, dict[str, int]] = dataclasses.field(default_factory=dict)
    params_crc32: list[int] = dataclasses.field(default_factory=list)  # per fragment
    last_loss: float = math.nan
    resumed_at_inner_step: int | None = None  # from a checkpoint; None: a cold start
    data_position: int = 0  # windows drawn from this rank's data shard so far
    island_size: int = 1  # ranks training data-parallel as this one learner
    rank_params_crc32: list[int] = dataclasses.field(default_factory=list)  # per rank, at the end


@dataclass
class SavedReplica:
    """A global fragment as a checkpoint holds it, to resume from without a snapshot."""

    fragment_id: int
    indices: list[int]
    version: int
    params: list[torch.Tensor]


class SyncSession:
    """Talks to the aggregator for one learner; the training loop stays the caller's."""

    def __init__(
        self,
        config: LearnerConfig,
        params: Sequence[torch.Tensor],
        fingerprint: Sequence[pb.ParamSpec],
        progress: Progress,
        tokens_per_step: int,
    ) -> None:
        self.config = config
        self.params = list(params)
        self.fingerprint = list(fingerprint)
        self.progress = progress
        self.tokens_per_step = tokens_per_step
        credentials = (
            None
            if config.insecure
            else channel_credentials(config.tls_ca, config.tls_cert, config.tls_key)
        )
        self.client = AggregatorClient(config.server, credentials, _auth_metadata(config))
        self.transport = GrpcTransport(self.client, lambda: self.session_id)
        self.session_id = ""
        self.lease_s = 10.0  # replaced by the server's value at Join
        self.sync: StreamingSync | None = None
        self.step = 0  # the schedule step, shared in phase by all learners (Schedule.resume_step)
        self.server_epoch = 0
        self.server_versions: list[int] = []  # per fragment, from the last heartbeat
        self.median_step_time_s = 0.0  # of the live learners, from the last heartbeat
        self.blocking = True  # sync mode: wait at merges; set at join from the server's mode
        self.resume: list[SavedReplica] | None = None  # set before open() to resume
        self._resync = threading.Event()  # set when the session is gone: join and re-sync
        self._rejoin_backoff = Backoff()
        self._next_rejoin_s = 0.0
        self._heartbeat_stop = threading.Event()
        self._phase_lock = threading.Lock()
        self._phase_debt = 0  # schedule steps to gain (> 0) or give back (< 0): phase alignment

    def open(self, stop: threading.Event) -> None:
        """Connect, join (pulling the global parameters) and start heartbeats.

        A join cut short by the server going away (a restart, a network cut: UNAVAILABLE)
        is tried again with backoff for up to connect_timeout_s, as later rejoins are; there
        is nothing to train on before the first one succeeds.
        """
        self.transport.stop_requested = stop
        deadline = time.monotonic() + self.config.connect_timeout_s
        self.client.wait_ready(self.config.connect_timeout_s)
        backoff = Backoff()
        while True:
            try:
                self._join(self.resume)
                break
            except grpc.RpcError as err:
                if not is_retryable(err) or time.monotonic() >= deadline:
                    raise
                delay = max(backoff.next_delay_s(), retry_after_s(err) or 0.0)
                log.warning(
                    "learner=%s join failed (%s); trying again in %.1f s",
                    self.config.learner_id,
                    err.code().name,
                    delay,
                )
                if stop.wait(delay):
                    raise  # asked to stop while the server is away: end with its error
        threading.Thread(target=self._heartbeat, daemon=True).start()

    def after_inner_step(self) -> bool:
        """Advance the schedule by one inner step: push and merge what it says, or rejoin.

        Returns True if the local parameters changed (a merge or a re-sync). Raises Stopped
        if asked to stop while waiting at a merge.
        """
        if self._resync.is_set():
            self.step += 1
            return self._try_rejoin()  # keeps training while the server is away
        assert self.sync is not None
        try:
            advance = max(0, self.pace() + self._phase_correction())
            changed = False
            for _ in range(advance):
                self.step += 1
                self.sync.push_phase(self.step, self.progress.inner_steps)
                changed |= bool(self.sync.merge_phase(self.step))
            if advance == 0:  # an extra inner step before the next push; merge what arrived
                changed |= bool(self.sync.merge_phase(self.step))
            return changed
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:
                raise
            log.warning(
                "learner=%s session lost (%s); rejoining", self.config.learner_id, err.details()
            )
            self._resync.set()
            return False

    def pace(self) -> int:
        """Schedule steps per inner step: 1, or with dynamic local updates (quorum, async)
        how many times slower this learner is than the live learners' median, at most H."""
        if not self.config.dynamic_local_updates or self.blocking:
            return 1
        mine = self.progress.compute_s / max(1, self.progress.inner_steps)
        if self.median_step_time_s <= 0 or mine <= 0:
            return 1
        return max(1, min(self.config.sync_every_steps, round(mine / self.median_step_time_s)))

    def _phase_correction(self) -> int:
        """+1 (one schedule step more) while this learner's schedule is behind the live
        learners', -1 while ahead, else 0: quorum and async, unless align_schedule is off.

        Learners that never wait drift apart in phase (evaluations, restarts, uneven speed).
        Then each push of a fragment lands in a round of its own, and most contributions are
        stale by the time they arrive, which the server discounts. Steering each learner's
        schedule step, one step at a time, towards the median the server reports keeps the
        pushes of a fragment together, so rounds gather everyone who is on time. A learner
        behind pushes a little sooner; one ahead trains a step more first: nobody waits.
        """
        if not self.config.align_schedule or self.blocking:
            return 0
        with self._phase_lock:
            if self._phase_debt > 0:
                self._phase_debt -= 1
                return 1
            if self._phase_debt < 0:
                self._phase_debt += 1
                return -1
            return 0

    def _set_phase_error(self, cluster_step: int, my_step: int) -> None:
        """Record how far the live learners' schedule (from a heartbeat) is from this
        learner's when it asked; within PHASE_DEADBAND steps counts as in phase.

        Only the phase matters (pushes repeat every H steps), so the error is taken modulo
        H, into [-H/2, H/2): a learner whole periods off never pauses its pushes for long."""
        error = cluster_step - my_step if cluster_step > 0 and my_step > 0 else 0
        h = self.config.sync_every_steps
        error = (error + h // 2) % h - h // 2
        with self._phase_lock:
            self._phase_debt = error if abs(error) >= PHASE_DEADBAND else 0

    def drain(self) -> None:
        """Merge the syncs still in flight after the last step, then take the global values.

        Ends with every local parameter equal to the newest server version this learner saw.
        If the server restarted meanwhile, the in-flight pushes are lost (they were never
        applied) and the learner re-syncs to the restored state instead.
        """
        assert self.sync is not None
        if not self._resync.is_set():
            self.sync.blocking = True  # the run is over: waiting costs no training
            try:
                self.sync.merge_phase(self.step + self.config.overlap_steps)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                self._resync.set()
        if self._resync.is_set():
            self._join()
            self.progress.rejoins += 1
        self.sync.load_globals()

    def close(self) -> None:
        """Stop heartbeats and syncs, leave the run, and record the totals in `progress`."""
        self._heartbeat_stop.set()
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

    def _try_rejoin(self) -> bool:
        """Join again and pull snapshots; if the server is still away, try later."""
        if time.monotonic() < self._next_rejoin_s:
            return False
        try:
            self._join()
        except grpc.RpcError as err:
            if not is_retryable(err):  # the server is away, or asks us to come back later
                raise
            delay = max(self._rejoin_backoff.next_delay_s(), retry_after_s(err) or 0.0)
            self._next_rejoin_s = time.monotonic() + delay
            log.warning(
                "learner=%s server unreachable (%s); training on, next try in %.1f s",
                self.config.learner_id,
                err.code().name,
                delay,
            )
            return False
        self._rejoin_backoff.reset()
        self._resync.clear()
        self.progress.rejoins += 1
        return True

    def _join(self, resume: list[SavedReplica] | None = None) -> None:
        cfg = self.config
        self.transport.abandon_in_flight()  # they belong to the old session, if any
        reply = self.client.join(cfg.learner_id, self.fingerprint)
        # Epoch first: a heartbeat that already uses the new session must see the new epoch.
        self.server_epoch = reply.server_epoch
        self.session_id, self.lease_s = reply.session_id, reply.lease_s
        log.info(
            "learner=%s joined epoch=%d mode=%s fragments=%d layout=%s",
            cfg.learner_id,
            reply.server_epoch,
            reply.mode,
            len(reply.fragments),
            reply.layout,
        )
        saved = {(r.fragment_id, tuple(r.indices)): r for r in resume or []}
        replicas, kept = [], set()
        for f in reply.fragments:
            replica = FragmentReplica(
                f.fragment_id,
                list(f.param_indices),
                [tuple(self.params[i].shape) for i in f.param_indices],
            )
            if f.version < 0:
                self._offer_initial_params(replica)
            mine = saved.get((f.fragment_id, tuple(f.param_indices)))
            if mine is not None and self._pull_since(replica, mine):
                if replica.version == mine.version:
                    kept.add(f.fragment_id)  # nobody moved it: keep the local progress
            else:
                # No retry loop here: if the server is gone again, _try_rejoin backs off.
                replica.apply(self.transport.pull(replica.fragment_id, -1, 0, retry=False))
            replicas.append(replica)
        schedule = Schedule(cfg.sync_every_steps, len(replicas), cfg.overlap_steps)
        self.blocking = reply.mode == "sync"  # quorum and async learners never wait
        if not self.blocking and reply.schedule_step > 0:
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
            blocking=self.blocking,
            start_step=self.progress.inner_steps,  # push_phase counts inner steps
        )
        for replica in replicas:
            if replica.fragment_id not in kept:
                merge(self.sync.local(replica), replica.params, alpha=0.0)
        if resume is not None:
            log.info(
                "learner=%s resumed versions=%s kept_local=%s pulled_bytes=%d",
                cfg.learner_id,
                [r.version for r in replicas],
                sorted(kept),
                self.client.traffic.received,
            )

    def _pull_since(self, replica: FragmentReplica, saved: SavedReplica) -> bool:
        """Bring a saved replica up to date with the updates since its version; False if
        the server cannot continue it (its state is not a continuation of ours)."""
        replica.params, replica.version = [p.clone() for p in saved.params], saved.version
        reply = self.transport.pull(replica.fragment_id, saved.version, 0, retry=False)
        try:
            replica.apply(reply)
        except RuntimeError as err:  # the checksum after the update chain does not match
            log.warning("learner=%s %s; pulling a snapshot", self.config.learner_id, err)
            return False
        if reply.version != replica.version or reply.params_crc32 != params_crc32(replica.params):
            log.warning(
                "learner=%s fragment %d: the server is at version %d, the checkpoint at %d; "
                "pulling a snapshot",
                self.config.learner_id,
                replica.fragment_id,
                reply.version,
                saved.version,
            )
            return False
        return True

    def _offer_initial_params(self, replica: FragmentReplica) -> None:
        header = pb.PushHeader(
            session_id=self.session_id,
            fragment_id=replica.fragment_id,
            base_version=-1,
            kind=pb.PUSH_KIND_INITIAL,
        )
        local = [self.params[i].detach() for i in replica.indices]
        try:
            self.client.push(header, encode_fragment(local, "fp32"))
            log.info(
                "learner=%s initialized fragment %d", self.config.learner_id, replica.fragment_id
            )
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise  # otherwise another learner was first: fine, we pull theirs

    def _heartbeat(self) -> None:
        while not self._heartbeat_stop.wait(self.lease_s / 3):
            request = pb.HeartbeatRequest(
                session_id=self.session_id,
                step=self.progress.inner_steps,
                tokens=self.progress.tokens,
                loss=self.progress.last_loss,
                step_time_s=self.progress.compute_s / max(1, self.progress.inner_steps),
                schedule_step=self.step,
            )
            session = request.session_id
            try:
                reply = self.client.heartbeat(request)
                if session != self.session_id:
                    continue  # a rejoin happened meanwhile; this answer is about the old one
                self.server_versions = list(reply.fragment_versions)
                self.median_step_time_s = reply.median_step_time_s
                self._set_phase_error(reply.schedule_step, request.schedule_step)
                if reply.server_epoch != self.server_epoch:
                    log.warning(
                        "learner=%s server restarted (new epoch); will re-sync",
                        self.config.learner_id,
                    )
                    self._resync.set()
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND and session == self.session_id:
                    self._resync.set()
                log.warning(
                    "learner=%s heartbeat failed: %s", self.config.learner_id, err.code().name
                )

    def _leave(self) -> None:
        if not self.session_id:
            return
        try:
            self.client.leave(self.session_id)
        except grpc.RpcError as err:
            log.warning("learner=%s leave failed: %s", self.config.learner_id, err.code().name)

    def _finish_progress(self) -> None:
        p, traffic = self.progress, self.client.traffic
        p.bytes_sent, p.bytes_received = traffic.sent, traffic.received
        p.bytes_by_fragment = traffic.by_fragment()
        p.stale_pushes = self.transport.stale_pushes
        if self.sync is not None:
            p.versions = [r.version for r in self.sync.replicas]
            p.params_crc32 = [params_crc32(r.params) for r in self.sync.replicas]
            p.blocked_on_sync_s = self.sync.stats.blocked_s
            p.fragment_syncs = self.sync.stats.syncs
            p.late_merges = self.sync.stats.late_merges
            p.skipped_pushes = self.sync.stats.skipped_pushes


def _auth_metadata(config: LearnerConfig) -> tuple[tuple[str, str], ...]:
    """The learner id and token that go with every call (server/auth.py). Without a token
    the id still goes: the server's rate limits are per learner (server/ratelimit.py)."""
    if not config.auth_token_file:
        return ((LEARNER_ID_HEADER, config.learner_id),)
    try:
        token = Path(config.auth_token_file).read_text().strip()
    except OSError as err:
        raise ValueError(
            f"cannot read auth_token_file {config.auth_token_file}: {err.strerror}"
        ) from err
    if not token:
        raise ValueError(f"auth_token_file {config.auth_token_file} is empty")
    return ((LEARNER_ID_HEADER, config.learner_id), ("authorization", f"Bearer {token}"))
