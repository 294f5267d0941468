"""The learner process: inner AdamW steps, with Streaming DiLoCo syncs of each fragment.

    config = build_config(LearnerConfig, {"server": "127.0.0.1:50051", "learner_id": "a"})
    summary = Learner(config).run(stop=threading.Event())

The syncs are the library's: rank 0 drives a DilocoSync (learner/api.py) exactly as a user's
own loop would, one `step()` after each inner step, so the protocol, the step bookkeeping and
the metrics are the same either way. This file is the built-in job around it: a small GPT on
a sharded corpus (learner/data.py), evaluation of the global parameters every H inner steps
(an outer step), periodic checkpoints to resume from (learner/checkpoint.py), and, under
torchrun, an island of data-parallel ranks that acts as one learner (learner/island.py): only
rank 0 holds a DilocoSync, counts progress and talks to the aggregator. With one fragment,
merge_alpha 0 and overlap_steps 0 this is plain DiLoCo.
"""

from __future__ import annotations

import copy
import logging
import math
import threading
import time
import zlib
from pathlib import Path
from typing import NamedTuple

import torch

from common.codec.fragment import params_crc32
from common.cpus import usable_cpus
from common.retry import Stopped
from learner.api import DilocoSync, fingerprint
from learner.checkpoint import JobCheckpoint, checkpoint_exists
from learner.config import LearnerConfig, resolve_device
from learner.data import BatchSampler, ShardedSampler, load_corpus
from learner.initial_params import load_initial_params
from learner.island import Island
from learner.model import GPT
from learner.progress import Progress
from learner.simulated_speed import SimulatedSpeed
from learner.sliced import local, shard_model

__all__ = ["Learner", "Progress", "initial_model"]

log = logging.getLogger("diloco.learner")


def initial_model(config: LearnerConfig, is_leader: bool = True) -> GPT:
    """The model a learner starts from: freshly initialised from the seed, or --init-params'
    file. When checkpoint_dir holds a checkpoint, the file is not read at all: the checkpoint
    replaces the parameters anyway, and a restart must not depend on a file that only the
    first start needed. Only an island's rank 0 reads it: the other ranks take rank 0's
    parameters when the run starts, and may not see its files."""
    model = GPT(config.model)
    ckpt = config.checkpoint
    if not ckpt.init_params or not is_leader:
        return model
    if ckpt.checkpoint_dir and checkpoint_exists(Path(ckpt.checkpoint_dir)):
        log.info(
            "learner=%s resumes from its checkpoint; --init-params not read",
            config.connection.learner_id,
        )
        return model
    load_initial_params(model, ckpt.init_params)
    log.info("learner=%s starts from %s", config.connection.learner_id, ckpt.init_params)
    return model


class InnerStep(NamedTuple):
    """What one inner step reports to DilocoSync.step()."""

    loss: float
    tokens: int  # of every rank of the island
    compute_s: float  # including the idle time of a --slowdown


class Learner:
    """The built-in job for one learner (or one island of ranks): data, model, evaluation
    and checkpoints around the DilocoSync that rank 0 drives."""

    def __init__(self, config: LearnerConfig, island: Island | None = None) -> None:
        """`island`: the ranks this learner spans (torchrun); default a single process."""
        self.config = config
        self.island = island = island or Island()
        model_cfg, data, training = config.model, config.data, config.training
        threads = training.torch_threads or max(
            1, usable_cpus() // (training.learners_per_host * island.local_size)
        )
        torch.set_num_threads(threads)
        torch.manual_seed(training.seed)
        self.device = island.start(resolve_device(training.device))
        # Initialised on the CPU, then moved: the same seed gives the same model anywhere.
        self.model = initial_model(config, island.is_leader).to(self.device)
        # Sharded (FSDP2, HSDP): every rank syncs its own slices (learner/sliced.py).
        self.sharded = island.distributed and training.island_sharding != "ddp"
        if self.sharded:
            if config.checkpoint.checkpoint_dir:
                raise ValueError(
                    "checkpoint_dir is not supported with island_sharding fsdp or hsdp: a "
                    "restarted sharded island joins again from the global parameters"
                )
            island.broadcast_params(list(self.model.parameters()))  # rank 0's, before slicing
            replicas = training.hsdp_replicas if training.island_sharding == "hsdp" else 1
            shard_model(self.model, list(self.model.blocks), replicas, self.device)
            self.train_model = self.model
        else:
            self.train_model = island.wrap(self.model)  # DDP across the island's ranks
        # Holds the global parameters for eval; a sharded island swaps them in instead.
        self.eval_model = None if self.sharded else copy.deepcopy(self.model)
        self.params = [p for _, p in self.model.named_parameters()]
        train, val = load_corpus(data.corpus, data.corpus_max_bytes)
        learner_id = config.connection.learner_id
        data_seed = training.seed * 1_000_003 + zlib.crc32(learner_id.encode())
        # The island's ranks split this learner's shard: rank r of N takes sub-shard r.
        self.batches = ShardedSampler(
            train,
            data.batch_size,
            model_cfg.block_size,
            data_seed,
            shard=data.data_shard * island.world_size + island.rank,
            shards=max(1, data.data_shards) * island.world_size,
            vocab_size=model_cfg.vocab_size,
        )
        eval_sampler = BatchSampler(val, data.batch_size, model_cfg.block_size, seed=1234)
        self.eval_set = [eval_sampler.next() for _ in range(training.eval_batches)]
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=training.inner_lr, weight_decay=training.weight_decay
        )
        self._lr_schedule = training.inner_lr_schedule()
        self._steps_taken = 0  # inner steps of this rank, a checkpoint's included
        self._simulated_speed = SimulatedSpeed(config.simulation)
        self._saved_params: list[torch.Tensor] = []  # a sharded island's, gathered at the end
        # DDP: rank 0 speaks for every rank's tokens; sharded: each rank for its own.
        tokens_per_step = data.batch_size * model_cfg.block_size
        tokens_per_step *= 1 if self.sharded else island.world_size
        self.sync = (
            DilocoSync(self.model, tokens_per_step=tokens_per_step, config=config.library())
            if island.is_leader or self.sharded
            else None  # only rank 0 talks to the aggregator
        )
        # Rank 0's progress is the sync's (it speaks for the island); the others count none.
        self.progress = self.sync.progress if self.sync else Progress(learner_id=learner_id)
        self.progress.island_size = island.world_size
        self._status = _StatusClock()
        self.checkpoint: JobCheckpoint | None = None
        if config.checkpoint.checkpoint_dir:
            specs = [(s.name, list(s.shape), s.dtype) for s in fingerprint(self.model)]
            self.checkpoint = JobCheckpoint(self, Path(config.checkpoint.checkpoint_dir), specs)
            self.checkpoint.restore()
            self._steps_taken = self.progress.inner_steps  # the checkpoint's, on every rank

    # -- the loop --------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> Progress:
        """Train until max_outer_steps, duration_s or `stop`; always leaves and closes.

        On an island rank 0 decides: when to stop, and what the parameters are after a sync.
        """
        island, started, checkpoint = self.island, time.monotonic(), self.checkpoint
        try:
            if self.sync is not None:
                self.sync.open(stop)
            self._share_params()  # every rank starts from the global values
            # Back by a checkpoint's train_wall_s: a resumed run's goes on from there.
            train_started = time.monotonic() - self.progress.train_wall_s
            self._record_eval()  # inside train_wall_s, as eval_s is
            while not island.agree([self._done(stop, started)])[0]:
                changed, stopped, outer_step = island.agree(self._advance(self._inner_step()))
                if changed:
                    self._share_params()
                if stopped:
                    break  # asked to stop while waiting at a merge
                if outer_step:
                    self._record_eval()
                self.progress.train_wall_s = time.monotonic() - train_started
                if checkpoint is not None and checkpoint.due(self.progress.inner_steps):
                    checkpoint.save()
            if self.sync is not None:
                self.sync.drain()  # merges the syncs in flight, unless asked to stop
            self._share_params()
            if checkpoint is not None:
                checkpoint.save()
            crc = params_crc32([local(p).detach().cpu() for p in self.params])
            self.progress.rank_params_crc32 = island.gather_object(crc)
            if self.sharded and self.config.observability.save_params:  # a collective
                self._saved_params = [p.full_tensor().detach().cpu() for p in self.params]
        finally:
            self.progress.data_position = self.batches.position
            if self.sync is not None:
                self.sync.close(drain=False)  # leave, after the final checkpoint
        return self.progress

    def _share_params(self) -> None:
        """DDP: every rank takes rank 0's parameters (after a merge); sharded: nothing to
        do, each rank merged its own slices."""
        if not self.sharded:
            self.island.broadcast_params(self.params)

    def _done(self, stop: threading.Event, started: float) -> bool:
        training, p = self.config.training, self.progress
        return (
            stop.is_set()
            or bool(training.max_outer_steps and p.outer_steps >= training.max_outer_steps)
            or bool(training.duration_s and time.monotonic() - started >= training.duration_s)
        )

    def _inner_step(self) -> InnerStep:
        t0 = time.perf_counter()
        self.train_model.train()
        x, y = (t.to(self.device) for t in self.batches.next())
        _, loss = self.train_model(x, y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # on an island, DDP averages the gradients of all ranks here
        # Every rank counts its own steps: it starts from the checkpoint's count, as rank 0's
        # progress does, and the island's ranks step together.
        self._steps_taken += 1
        lr = self.config.training.inner_lr * self._lr_schedule.factor(self._steps_taken)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.progress.inner_lr = lr
        self.optimizer.step()
        loss_value = loss.item()
        idle_s = self._simulated_speed.idle_s(time.perf_counter() - t0)
        if idle_s > 0:  # simulations only: a slower island idles as if the step took longer
            time.sleep(idle_s)
        compute_s = time.perf_counter() - t0
        return InnerStep(loss_value, x.numel() * self.island.world_size, compute_s)

    def _advance(self, step: InnerStep) -> list[int]:
        """[parameters changed, asked to stop while waiting at a merge, an outer step ended]:
        the sync's step on rank 0 (all 0 on the other ranks, which follow rank 0's)."""
        if self.sync is None:
            return [0, 0, 0]
        outer_steps = self.sync.outer_steps
        try:
            changed = self.sync.step(step.loss, step.tokens, step.compute_s)
        except Stopped:
            return [0, 1, 0]
        return [int(changed), 0, int(self.sync.outer_steps > outer_steps)]

    # -- evaluation and status -------------------------------------------------------------

    def _record_eval(self) -> None:
        """Evaluate the global parameters (the learner's replicas) on the validation split."""
        if self.sync is None:
            return  # not rank 0: the island's leader evaluates
        started = time.perf_counter()
        if self.sharded:
            losses = self._eval_sharded()
        else:
            assert self.eval_model is not None
            eval_params = [p for _, p in self.eval_model.named_parameters()]
            with torch.no_grad():
                for i, g in self.sync.global_params().items():
                    eval_params[i].copy_(g)
            losses = self._eval_losses(self.eval_model)
        if not self.island.is_leader:
            return  # a sharded rank evaluated with the others; the leader reports
        loss = sum(losses) / len(losses)
        self.progress.eval_losses.append(loss)
        self.progress.eval_s += time.perf_counter() - started
        self._log_status(loss)

    def _eval_losses(self, model: torch.nn.Module) -> list[float]:
        model.eval()
        with torch.no_grad():
            return [model(x.to(self.device), y.to(self.device))[1].item() for x, y in self.eval_set]

    def _eval_sharded(self) -> list[float]:
        """The losses of the global slices, swapped into the sharded model (every rank
        together: its forward gathers the slices), then the local ones back."""
        assert self.sync is not None
        with torch.no_grad():
            kept = [local(p).clone() for p in self.params]
            for i, g in self.sync.global_params().items():
                local(self.params[i]).copy_(g)
            try:
                return self._eval_losses(self.model)
            finally:
                for p, mine in zip(self.params, kept, strict=True):
                    local(p).copy_(mine)
                self.model.train()

    def _log_status(self, eval_loss: float) -> None:
        p, stats, traffic = self.progress, self.sync.stats, self.sync.traffic
        tokens_per_s, last_sync_s = self._status.due(
            self.config.observability.status_every_s, p.tokens, stats.syncs
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
            self.sync.versions,
            eval_loss,
            p.last_loss,
            p.tokens,
            tokens_per_s,
            last_sync_s,
            stats.blocked_s,
            traffic.sent,
            traffic.received,
        )

    def save_params(self, path: str) -> None:
        """Save the full parameters (rank 0; a sharded island gathered them in run())."""
        names = [n for n, _ in self.model.named_parameters()]
        params = self._saved_params if self.sharded else self.params
        torch.save({n: p.detach().cpu().clone() for n, p in zip(names, params, strict=True)}, path)


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
