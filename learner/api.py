"""Bring your own model: Streaming DiLoCo syncs from inside your own training loop.

    from learner.api import DilocoSync

    model = MyModel()                                   # any torch.nn.Module
    optimizer = torch.optim.AdamW(model.parameters())   # any inner optimizer
    with DilocoSync(model, server="127.0.0.1:50051", learner_id="a", insecure=True,
                    sync_every_steps=50, tokens_per_step=batch_size * seq_len) as sync:
        serve_metrics("0.0.0.0:9101", sync.metrics_registry())   # optional, common/metrics_http
        for x, y in batches:                            # your data, your loss
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            sync.step(loss=loss.item())                 # may push and merge fragments
            if sync.outer_steps == 100:
                break

`step()` advances the fragment schedule by one inner step: on schedule it sends a fragment's
pseudo-gradient (in the background) and later merges the new global value into the model's
parameters in place. Your optimizer's state is left alone, as in DiLoCo. Leaving the `with`
block normally waits for the syncs still in flight and ends with the model holding the global
parameters; leaving it by an exception just leaves the run. The built-in learner
(learner/trainer.py) drives this same class, so everything the server offers (sync, quorum
and async modes, TLS, tokens, rejoin after a server restart) works the same way, and the
same Prometheus metrics (learner/metrics.py) describe either.
"""

from __future__ import annotations

import math
import threading
import time
from types import TracebackType
from typing import Any

import torch
from prometheus_client import CollectorRegistry
from torch import nn

from common.config import build_config
from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.retry import Stopped
from common.traffic import Traffic
from learner.checkpoint import replicas_from_state, replicas_to_state
from learner.config import DilocoSyncConfig
from learner.metrics import learner_registry
from learner.progress import Progress
from learner.session import SyncSession
from learner.sliced import LocalSlices, ShardedIsland, is_sharded
from learner.streaming import SyncStats

__all__ = ["DilocoSync", "Stopped", "fingerprint"]


def fingerprint(model: nn.Module) -> list[pb.ParamSpec]:
    """Name, shape and dtype of each of the model's parameters, as Join announces them."""
    return [
        pb.ParamSpec(name=name, shape=list(p.shape), dtype=str(p.dtype).removeprefix("torch."))
        for name, p in model.named_parameters()
    ]


class DilocoSync:
    """Joins a run with your model and keeps its parameters in sync, one `step()` at a time."""

    def __init__(
        self,
        model: nn.Module,
        *,
        tokens_per_step: int = 1,
        stop: threading.Event | None = None,
        config: DilocoSyncConfig | None = None,
        **settings: Any,
    ) -> None:
        """`settings`: the connection and sync settings of `diloco-learner --help` (server,
        learner_id, TLS, sync_every_steps, ...), or all of them at once as `config`.
        A model whose parameters are DTensors (wrapped with fully_shard) makes this process
        one rank of a sharded island (learner/sliced.py): every rank makes its DilocoSync
        and calls step() after each inner step.
        `tokens_per_step`: the tokens (or samples) one inner step trains on (on this rank,
        for a sharded island: the island's are its ranks' sum), which the server
        weights pushes by; declared at Join, it bounds what each push may claim. `stop`: set
        it (e.g. from a signal handler) to interrupt a wait at a merge, which then raises
        Stopped."""
        if config is not None and settings:
            raise ValueError("give DilocoSync either config or settings, not both")
        if tokens_per_step < 1:
            raise ValueError(f"tokens_per_step must be >= 1, got {tokens_per_step}")
        self.config = config or build_config(DilocoSyncConfig, settings)
        self.model = model
        params = [p for _, p in model.named_parameters()]
        if not params:
            raise ValueError("the model has no parameters to train")
        self.progress = Progress(learner_id=self.config.connection.learner_id)
        self.tokens_per_step = tokens_per_step
        # A model sharded with fully_shard (FSDP2, HSDP): this rank syncs its slices.
        self.island = ShardedIsland(params) if is_sharded(params) else None
        island_tokens = tokens_per_step * (self.island.world_size if self.island else 1)
        self.session = SyncSession(
            self.config,
            LocalSlices(params) if self.island else params,
            fingerprint(model),
            self.progress,
            island_tokens,
            self.island,
        )
        self._stop = stop or threading.Event()
        self._open = self._closed = False
        self._last_step_s = 0.0

    def open(self, stop: threading.Event | None = None) -> DilocoSync:
        """Connect and join; the model's parameters become the run's global parameters (the
        first learner to join offers its own as the initial ones). `stop`: replaces the one
        given at construction."""
        if self._closed:
            raise RuntimeError("DilocoSync is closed: make a new one to join again")
        self._stop = stop or self._stop
        self.session.open(self._stop)
        self._open = True
        self._last_step_s = time.perf_counter()
        return self

    def step(
        self, loss: float = math.nan, tokens: int | None = None, compute_s: float | None = None
    ) -> bool:
        """Call once after each inner optimizer step. Returns True if the model's parameters
        were changed by a merge, or by a rejoin after a server restart that gave a fragment
        the server's values (it had moved it, or lost versions).

        `tokens`: this step's, if not tokens_per_step. `compute_s`: the seconds the step
        computed, which the server adapts its grace window to (default: the time since the
        last step() returned; pass it if your loop also evaluates or saves in between)."""
        if not self._open:
            raise RuntimeError("DilocoSync.step() before open(): use it as a context manager")
        p = self.progress
        p.inner_steps += 1
        p.tokens += self.tokens_per_step if tokens is None else tokens
        p.last_loss = loss
        p.compute_s += time.perf_counter() - self._last_step_s if compute_s is None else compute_s
        before = self.session.step
        changed = self.session.after_inner_step()
        # An outer step each time the schedule passes a multiple of H (it may advance several
        # steps at once: dynamic local updates).
        h = self.config.sync.sync_every_steps
        if self.session.step // h > before // h:
            p.outer_steps += 1
        self._last_step_s = time.perf_counter()
        return changed

    def drain(self) -> None:
        """Merge the syncs in flight and take the global parameters, still in the run (so a
        final checkpoint can be written before close() leaves); a no-op once stopped."""
        if self._open and not self._stop.is_set():
            self.session.drain()

    def close(self, drain: bool = True) -> Progress:
        """Leave the run; with `drain`, first merge the syncs in flight and take the global
        parameters. Returns the totals (steps, tokens, bytes, versions)."""
        if self._closed:
            return self.progress
        self._closed = True
        try:
            if drain:
                self.drain()
        finally:
            self._open = False
            self.session.close()  # also closes the channel of a session never opened
        return self.progress

    def __enter__(self) -> DilocoSync:
        return self.open()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(drain=exc_type is None)

    # -- what the run looks like from here (status lines, metrics, evaluation) ---------------

    @property
    def outer_steps(self) -> int:
        return self.progress.outer_steps

    @property
    def schedule_step(self) -> int:
        """The fragment schedule's step, which all learners keep in phase."""
        return self.session.step

    @property
    def versions(self) -> list[int]:
        """The global version of each fragment this learner holds."""
        sync = self.session.sync
        return [r.version for r in sync.replicas] if sync else []

    @property
    def server_versions(self) -> list[int]:
        """The server's version of each fragment, as of the last heartbeat."""
        return self.session.heartbeat.server_versions

    @property
    def shards_away(self) -> int:
        """Shards (a plain server is shard 0 of 1) that do not know this learner's session
        now: restarted and not joined again yet, or never reached. Their fragments do not
        sync meanwhile."""
        return len(self.session.client.lost_shards())

    @property
    def stats(self) -> SyncStats | None:
        """Counters of the fragment syncs since the last join (blocked_s: of the whole run,
        a resumed one's included); None before the first."""
        sync = self.session.sync
        return sync.stats if sync else None

    @property
    def traffic(self) -> Traffic:
        """Bytes sent to and received from the aggregator, per fragment."""
        return self.session.client.traffic

    def global_params(self) -> dict[int, torch.Tensor]:
        """The run's global value of each synced parameter (the replicas this learner holds,
        on the CPU; on a sharded island, this rank's slices), by its index in
        `model.named_parameters()`. Read them, do not change them: copy into a model of the
        same shape (or the same slices) to evaluate the global parameters."""
        sync = self.session.sync
        replicas = sync.replicas if sync else []
        return {i: g for r in replicas for i, g in zip(r.indices, r.params, strict=True)}

    def metrics_registry(self) -> CollectorRegistry:
        """A fresh Prometheus registry of this learner's metrics, read at scrape time; serve
        it with common/metrics_http.serve_metrics(listen, registry)."""
        return learner_registry(self)

    # -- resuming ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What to save beside your model and optimizer to resume after a crash: the step
        counts, the timing counters (so that step times and compute seconds go on as if
        there had been no restart) and the global fragments held (a resumed learner pulls
        only what changed)."""
        p = self.progress
        return {
            "inner_steps": p.inner_steps,
            "outer_steps": p.outer_steps,
            "tokens": p.tokens,
            **p.timing_state(),
            "fragments": replicas_to_state(self.session.saved_replicas()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from state_dict()'s output; call before open(), after loading your model.
        A state without the timing counters still loads: they start again from zero here
        (Progress.resume_timing)."""
        if self._open:
            raise RuntimeError("load_state_dict() must come before open()")
        for name in ("inner_steps", "outer_steps", "tokens"):
            setattr(self.progress, name, int(state[name]))
        self.progress.resume_timing(state)
        self.progress.resumed_at_inner_step = self.progress.inner_steps
        self.session.resume = replicas_from_state(state["fragments"])
