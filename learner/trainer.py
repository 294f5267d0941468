"""The learner process: inner AdamW steps, with Streaming DiLoCo syncs of each fragment.

    learner = Learner(LearnerConfig(server="127.0.0.1:50051", learner_id="a"))
    summary = learner.run(stop=threading.Event())

The first learner to join hands the server its initial parameters; every learner then starts
from the server's copy, so all replicas begin identical. Fragment syncs follow
learner/streaming.py's schedule on a background thread. Every H inner steps (an outer step)
the learner evaluates the global parameters on the validation split. With one fragment,
merge_alpha 0 and overlap_steps 0 this is plain DiLoCo.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.retry import RETRYABLE, Backoff, Stopped
from common.rpc import LEARNER_ID_HEADER
from common.tls import channel_credentials
from common.wire import encode_fragment, params_crc32
from learner.client import AggregatorClient
from learner.config import LearnerConfig, resolve_device
from learner.data import BatchSampler, ShardedSampler, load_corpus
from learner.model import GPT
from learner.streaming import FragmentReplica, Schedule, StreamingSync
from learner.transport import GrpcTransport

log = logging.getLogger("diloco.learner")


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


class Learner:
    def __init__(self, config: LearnerConfig) -> None:
        self.config = config
        threads = config.torch_threads or max(1, (os.cpu_count() or 1) // config.learners_per_host)
        torch.set_num_threads(threads)
        torch.manual_seed(config.seed)
        self.device = resolve_device(config.device)
        # Initialised on the CPU, then moved: the same seed gives the same model anywhere.
        self.model = GPT(config.model_config()).to(self.device)
        self.eval_model = copy.deepcopy(self.model)  # holds the global parameters for eval
        self.params = [p for _, p in self.model.named_parameters()]
        self.fingerprint = [
            pb.ParamSpec(name=name, shape=list(p.shape), dtype=str(p.dtype).removeprefix("torch."))
            for name, p in self.model.named_parameters()
        ]
        train, val = load_corpus(config.corpus, config.corpus_max_bytes)
        data_seed = config.seed * 1_000_003 + zlib.crc32(config.learner_id.encode())
        self.batches = ShardedSampler(
            train,
            config.batch_size,
            config.block_size,
            data_seed,
            shard=config.data_shard,
            shards=max(1, config.data_shards),
            vocab_size=config.vocab_size,
        )
        eval_sampler = BatchSampler(val, config.batch_size, config.block_size, seed=1234)
        self.eval_set = [eval_sampler.next() for _ in range(config.eval_batches)]
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.inner_lr, weight_decay=config.weight_decay
        )
        credentials = (
            None
            if config.insecure
            else channel_credentials(config.tls_ca, config.tls_cert, config.tls_key)
        )
        self.client = AggregatorClient(config.server, credentials, _auth_metadata(config))
        self.transport = GrpcTransport(self.client, lambda: self.session_id)
        self.progress = Progress(learner_id=config.learner_id)
        self.session_id = ""
        self.lease_s = 10.0  # replaced by the server's value at Join
        self.sync: StreamingSync | None = None
        self.step = 0  # the schedule step, shared in phase by all learners (Schedule.resume_step)
        self.server_epoch = 0
        self.server_versions: list[int] = []  # per fragment, from the last heartbeat
        self._resync = threading.Event()  # set when the session is gone: join and re-sync
        self._rejoin_backoff = Backoff()
        self._status = _StatusClock()
        self._next_rejoin_s = 0.0

    # -- the loop --------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> Progress:
        """Train until max_outer_steps, duration_s or `stop`; always leaves and closes."""
        cfg, started = self.config, time.monotonic()
        heartbeat_stop = threading.Event()
        self.transport.stop_requested = stop
        try:
            self.client.wait_ready(cfg.connect_timeout_s)
            self._join()
            threading.Thread(target=self._heartbeat, args=(heartbeat_stop,), daemon=True).start()
            self._record_eval()
            train_started = time.monotonic()
            while not stop.is_set():
                if cfg.max_outer_steps and self.progress.outer_steps >= cfg.max_outer_steps:
                    break
                if cfg.duration_s and time.monotonic() - started >= cfg.duration_s:
                    break
                self.step += 1
                self._inner_step()
                if self._resync.is_set():
                    self._try_rejoin()  # keeps training while the server is away
                else:
                    try:
                        self._sync_step(self.step)
                    except Stopped:
                        break  # asked to stop while waiting at a merge
                if self.step % cfg.sync_every_steps == 0:
                    self.progress.outer_steps += 1
                    self._record_eval()
                self.progress.train_wall_s = time.monotonic() - train_started
            if not stop.is_set():
                self._drain(self.step)
        finally:
            heartbeat_stop.set()
            self.transport.close()
            self._leave()
            self._finish_progress()
            self.client.close()
        return self.progress

    def _inner_step(self) -> None:
        t0 = time.perf_counter()
        self.model.train()
        x, y = (t.to(self.device) for t in self.batches.next())
        _, loss = self.model(x, y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.progress.inner_steps += 1
        self.progress.tokens += x.numel()
        self.progress.last_loss = loss.item()
        if self.config.slowdown > 1:  # a slower island: idle as if the step took longer
            time.sleep((time.perf_counter() - t0) * (self.config.slowdown - 1))
        self.progress.compute_s += time.perf_counter() - t0

    def _sync_step(self, step: int) -> None:
        assert self.sync is not None
        try:
            self.sync.push_phase(step)
            self.sync.merge_phase(step)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:
                raise
            log.warning(
                "learner=%s session lost (%s); rejoining", self.config.learner_id, err.details()
            )
            self._resync.set()

    def _try_rejoin(self) -> None:
        """Join again and pull snapshots; if the server is still away, try later."""
        if time.monotonic() < self._next_rejoin_s:
            return
        try:
            self._join()
        except grpc.RpcError as err:
            if err.code() not in RETRYABLE:
                raise
            delay = self._rejoin_backoff.next_delay_s()
            self._next_rejoin_s = time.monotonic() + delay
            log.warning(
                "learner=%s server unreachable (%s); training on, next try in %.1f s",
                self.config.learner_id,
                err.code().name,
                delay,
            )
            return
        self._rejoin_backoff.reset()
        self._resync.clear()
        self.progress.rejoins += 1

    def _drain(self, last_step: int) -> None:
        """Merge the syncs still in flight after the last step, then take the global values.

        Ends with every local parameter equal to the newest server version this learner saw.
        If the server restarted meanwhile, the in-flight pushes are lost (they were never
        applied) and the learner re-syncs to the restored state instead.
        """
        assert self.sync is not None
        if not self._resync.is_set():
            self.sync.blocking = True  # the run is over: waiting costs no training
            try:
                self.sync.merge_phase(last_step + self.config.overlap_steps)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                self._resync.set()
        if self._resync.is_set():
            self._join()
            self.progress.rejoins += 1
        self.sync.load_globals()

    # -- protocol steps --------------------------------------------------------------------

    def _join(self) -> None:
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
        replicas = [
            FragmentReplica(
                f.fragment_id,
                list(f.param_indices),
                [tuple(self.params[i].shape) for i in f.param_indices],
            )
            for f in reply.fragments
        ]
        for f, replica in zip(reply.fragments, replicas, strict=True):
            if f.version < 0:
                self._offer_initial_params(replica)
            # No retry loop here: if the server is gone again, _try_rejoin backs off.
            replica.apply(self.transport.pull(replica.fragment_id, -1, 0, retry=False))
        schedule = Schedule(cfg.sync_every_steps, len(replicas), cfg.overlap_steps)
        self.step = schedule.resume_step([r.version for r in replicas])
        self.sync = StreamingSync(
            self.params,
            replicas,
            schedule,
            self.transport,
            cfg.push_codec,
            cfg.merge_alpha,
            tokens_per_step=cfg.batch_size * cfg.block_size,
            blocking=reply.mode == "sync",  # quorum and async learners never wait
            start_step=self.step,
        )
        self.sync.load_globals()

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

    def _heartbeat(self, stop: threading.Event) -> None:
        while not stop.wait(self.lease_s / 3):
            request = pb.HeartbeatRequest(
                session_id=self.session_id,
                step=self.progress.inner_steps,
                tokens=self.progress.tokens,
                loss=self.progress.last_loss,
                step_time_s=self.progress.compute_s / max(1, self.progress.inner_steps),
            )
            session = request.session_id
            try:
                reply = self.client.heartbeat(request)
                if session != self.session_id:
                    continue  # a rejoin happened meanwhile; this answer is about the old one
                self.server_versions = list(reply.fragment_versions)
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

    def _record_eval(self) -> None:
        """Evaluate the global parameters (the learner's replicas) on the validation split."""
        assert self.sync is not None
        started = time.perf_counter()
        eval_params = [p for _, p in self.eval_model.named_parameters()]
        with torch.no_grad():
            for replica in self.sync.replicas:
                for i, g in zip(replica.indices, replica.params, strict=True):
                    eval_params[i].copy_(g)
            self.eval_model.eval()
            losses = [
                self.eval_model(x.to(self.device), y.to(self.device))[1].item()
                for x, y in self.eval_set
            ]
        loss = sum(losses) / len(losses)
        self.progress.eval_losses.append(loss)
        self.progress.eval_s += time.perf_counter() - started
        p = self.progress
        tokens_per_s, last_sync_s = self._status.due(
            self.config.status_every_s, p.tokens, self.sync.stats.syncs
        )
        if tokens_per_s is None:
            return
        log.info(
            "learner=%s outer_step=%d step=%d versions=%s eval_loss=%.4f train_loss=%.4f "
            "tokens=%d tokens_per_s=%.0f last_sync_s_ago=%.1f blocked_s=%.2f sent_bytes=%d "
            "received_bytes=%d",
            p.learner_id,
            p.outer_steps,
            p.inner_steps,
            [r.version for r in self.sync.replicas],
            loss,
            p.last_loss,
            p.tokens,
            tokens_per_s,
            last_sync_s,
            self.sync.stats.blocked_s,
            self.client.traffic.sent,
            self.client.traffic.received,
        )

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

    def save_params(self, path: str) -> None:
        torch.save({n: p.detach().cpu().clone() for n, p in self.model.named_parameters()}, path)


class _StatusClock:
    """When the next status line is due, and the rates it reports since the last one."""

    def __init__(self) -> None:
        self.last_s = -math.inf
        self.last_tokens = 0
        self.syncs = -1
        self.last_sync_s = time.monotonic()

    def due(self, every_s: float, tokens: int, syncs: int) -> tuple[float | None, float]:
        """(tokens/s since the last line, seconds since the last merged sync) if a line is
        due now, else (None, ...)."""
        now = time.monotonic()
        if syncs != self.syncs:
            self.syncs, self.last_sync_s = syncs, now
        if now - self.last_s < every_s:
            return None, 0.0
        elapsed = now - self.last_s
        rate = (tokens - self.last_tokens) / elapsed if math.isfinite(elapsed) else 0.0
        self.last_s, self.last_tokens = now, tokens
        return rate, now - self.last_sync_s


def _auth_metadata(config: LearnerConfig) -> tuple[tuple[str, str], ...]:
    """The learner id and token that go with every call (server/auth.py); none if unset."""
    if not config.auth_token_file:
        return ()
    try:
        token = Path(config.auth_token_file).read_text().strip()
    except OSError as err:
        raise ValueError(
            f"cannot read auth_token_file {config.auth_token_file}: {err.strerror}"
        ) from err
    if not token:
        raise ValueError(f"auth_token_file {config.auth_token_file} is empty")
    return ((LEARNER_ID_HEADER, config.learner_id), ("authorization", f"Bearer {token}"))
