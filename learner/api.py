"""Bring your own model: Streaming DiLoCo syncs from inside your own training loop.

    from learner.api import DilocoSync

    model = MyModel()                                   # any torch.nn.Module
    optimizer = torch.optim.AdamW(model.parameters())   # any inner optimizer
    with DilocoSync(model, server="127.0.0.1:50051", learner_id="a", insecure=True,
                    sync_every_steps=50, tokens_per_step=batch_size * seq_len) as sync:
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
parameters; leaving it by an exception just leaves the run. The protocol is the built-in
learner's (learner/session.py), so everything the server offers (sync, quorum and async
modes, TLS, tokens, rejoin after a server restart) works the same way.
"""

from __future__ import annotations

import math
import threading
import time
from types import TracebackType
from typing import Any

from torch import nn

from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.retry import Stopped
from learner.checkpoint import replicas_from_state, replicas_to_state
from learner.config import LearnerConfig
from learner.session import Progress, SyncSession

__all__ = ["DilocoSync", "Stopped", "SETTINGS"]

# The LearnerConfig fields that matter when the model, data and loop are yours.
SETTINGS = frozenset(
    {
        "server",
        "learner_id",
        "sync_every_steps",
        "overlap_steps",
        "merge_alpha",
        "push_codec",
        "insecure",
        "tls_ca",
        "tls_cert",
        "tls_key",
        "auth_token_file",
        "connect_timeout_s",
    }
)


class DilocoSync:
    """Joins a run with your model and keeps its parameters in sync, one `step()` at a time."""

    def __init__(
        self,
        model: nn.Module,
        *,
        tokens_per_step: int = 1,
        stop: threading.Event | None = None,
        **settings: Any,
    ) -> None:
        """`settings`: any of SETTINGS (see `diloco-learner --help`). `tokens_per_step`: the
        tokens (or samples) one inner step trains on, which the server weights pushes by.
        `stop`: set it (e.g. from a signal handler) to interrupt a wait at a merge, which
        then raises Stopped."""
        unknown = sorted(set(settings) - SETTINGS)
        if unknown:
            known = ", ".join(sorted(SETTINGS))
            raise ValueError(f"unknown setting {unknown[0]!r} for DilocoSync; it takes {known}")
        if tokens_per_step < 1:
            raise ValueError(f"tokens_per_step must be >= 1, got {tokens_per_step}")
        self.config = LearnerConfig(**settings)
        self.model = model
        named = list(model.named_parameters())
        if not named:
            raise ValueError("the model has no parameters to train")
        fingerprint = [
            pb.ParamSpec(name=name, shape=list(p.shape), dtype=str(p.dtype).removeprefix("torch."))
            for name, p in named
        ]
        self.progress = Progress(learner_id=self.config.learner_id)
        self.tokens_per_step = tokens_per_step
        self.session = SyncSession(
            self.config, [p for _, p in named], fingerprint, self.progress, tokens_per_step
        )
        self._stop = stop or threading.Event()
        self._open = self._closed = False
        self._last_step_s = 0.0

    def open(self) -> DilocoSync:
        """Connect and join; the model's parameters become the run's global parameters (the
        first learner to join offers its own as the initial ones)."""
        if self._closed:
            raise RuntimeError("DilocoSync is closed: make a new one to join again")
        self.session.open(self._stop)
        self._open = True
        self._last_step_s = time.perf_counter()
        return self

    def step(self, loss: float = math.nan, tokens: int | None = None) -> bool:
        """Call once after each inner optimizer step. Returns True if the model's parameters
        were changed by a merge (or a re-sync after the server restarted)."""
        if not self._open:
            raise RuntimeError("DilocoSync.step() before open(): use it as a context manager")
        now = time.perf_counter()
        p = self.progress
        p.inner_steps += 1
        p.tokens += self.tokens_per_step if tokens is None else tokens
        p.last_loss = loss
        p.compute_s += now - self._last_step_s  # the step time the server adapts its grace to
        before = self.session.step
        changed = self.session.after_inner_step()
        # An outer step each time the schedule passes a multiple of H (as in the trainer: it
        # may advance several steps at once, with dynamic local updates or after a rejoin).
        h = self.config.sync_every_steps
        if self.session.step // h > before // h:
            p.outer_steps += 1
        self._last_step_s = time.perf_counter()
        return changed

    def close(self, drain: bool = True) -> Progress:
        """Leave the run; with `drain`, first merge the syncs in flight and take the global
        parameters. Returns the totals (steps, tokens, bytes, versions)."""
        if self._closed:
            return self.progress
        self._closed = True
        try:
            if self._open and drain and not self._stop.is_set():
                self.session.drain()
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

    @property
    def outer_steps(self) -> int:
        return self.progress.outer_steps

    @property
    def versions(self) -> list[int]:
        """The global version of each fragment this learner holds."""
        sync = self.session.sync
        return [r.version for r in sync.replicas] if sync else []

    def state_dict(self) -> dict[str, Any]:
        """What to save beside your model and optimizer to resume after a crash: the step
        counts and the global fragments held (a resumed learner pulls only what changed)."""
        return {
            "inner_steps": self.progress.inner_steps,
            "outer_steps": self.progress.outer_steps,
            "tokens": self.progress.tokens,
            "fragments": replicas_to_state(self.session.saved_replicas()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from state_dict()'s output; call before open(), after loading your model."""
        if self._open:
            raise RuntimeError("load_state_dict() must come before open()")
        for name in ("inner_steps", "outer_steps", "tokens"):
            setattr(self.progress, name, int(state[name]))
        self.progress.resumed_at_inner_step = self.progress.inner_steps
        self.session.resume = replicas_from_state(state["fragments"])
