"""The DiLoCo learner: H inner AdamW steps, push Δ = θ_global − θ_local, pull the new θ_global.

    learner = Learner(LearnerConfig(server="127.0.0.1:50051", learner_id="a"))
    summary = learner.run(stop=threading.Event())

The first learner to join hands the server its initial parameters; every learner then starts
from the server's copy, so all replicas begin identical. After each outer step the learner
loads the global parameters exactly (checked by checksum) and evaluates them on the
validation split.
"""

from __future__ import annotations

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

from common.codec import CODECS
from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.wire import decode_fragment, encode_fragment, params_crc32
from learner.client import AggregatorClient
from learner.data import BatchSampler, load_text_corpus, load_token_file, stdlib_dir
from learner.model import GPT, GPTConfig

log = logging.getLogger("diloco.learner")

PULL_WAIT_S = 20.0


@dataclass(kw_only=True)
class LearnerConfig(GPTConfig):
    server: str = "127.0.0.1:50051"
    """host:port of the aggregator."""
    learner_id: str = ""
    """Unique name of this learner (default: hostname-pid)."""
    sync_every_steps: int = 50
    """H: inner steps between two pushes."""
    batch_size: int = 16
    """Sequences per inner step."""
    inner_lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    push_codec: str = "fp4_e2m1"
    """Codec of the pushed pseudo-gradients: fp4_e2m1, bf16 or fp32."""
    max_outer_steps: int = 0
    """Stop after this many outer steps (0: no limit)."""
    duration_s: float = 0.0
    """Stop at the first outer step after this many seconds (0: no limit)."""
    corpus: str = "stdlib"
    """`stdlib` (this Python's library sources), a folder of text files, or a .bin token file."""
    corpus_max_bytes: int = 4 << 20
    """Read at most this many bytes of text per split."""
    eval_batches: int = 8
    """Validation batches evaluated after every outer step."""
    seed: int = 0
    """Seed of the model initialisation; the data order also mixes in the learner id."""
    torch_threads: int = 0
    """Threads for torch (0: the CPU count divided by --learners-per-host)."""
    learners_per_host: int = 1
    """How many learners share this host, to size the default thread count."""
    connect_timeout_s: float = 30.0
    """Give up if the server cannot be reached for this long at start."""
    summary_file: str = ""
    """If set, write the final summary as JSON here."""
    save_params: str = ""
    """If set, save the final model parameters here (torch.save of a name -> tensor dict)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.push_codec not in CODECS:
            raise ValueError(
                f"push_codec must be one of {', '.join(CODECS)}, got {self.push_codec!r}"
            )
        positive = ("sync_every_steps", "batch_size", "eval_batches", "learners_per_host")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_outer_steps", "duration_s", "torch_threads", "corpus_max_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.inner_lr > 0:
            raise ValueError(f"inner_lr must be > 0, got {self.inner_lr}")
        if ":" not in self.server:
            raise ValueError(f"server must be host:port, got {self.server!r}")
        if not self.learner_id:
            self.learner_id = f"{os.uname().nodename}-{os.getpid()}"

    def model_config(self) -> GPTConfig:
        return GPTConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(GPTConfig)})


@dataclass
class Progress:
    """What the learner has done so far; the final summary is this as a dict."""

    learner_id: str
    outer_steps: int = 0
    inner_steps: int = 0
    tokens: int = 0
    version: int = -1
    eval_losses: list[float] = dataclasses.field(default_factory=list)
    compute_s: float = 0.0
    blocked_on_sync_s: float = 0.0
    stale_pushes: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    params_crc32: int = 0
    last_loss: float = math.nan


class Learner:
    def __init__(self, config: LearnerConfig) -> None:
        self.config = config
        threads = config.torch_threads or max(1, (os.cpu_count() or 1) // config.learners_per_host)
        torch.set_num_threads(threads)
        torch.manual_seed(config.seed)
        self.model = GPT(config.model_config())
        self.params = [p for _, p in self.model.named_parameters()]
        self.fingerprint = [
            pb.ParamSpec(name=name, shape=list(p.shape), dtype=str(p.dtype).removeprefix("torch."))
            for name, p in self.model.named_parameters()
        ]
        self.shapes = [tuple(p.shape) for p in self.params]
        train, val = _load_corpus(config)
        data_seed = config.seed * 1_000_003 + _stable_hash(config.learner_id)
        self.batches = BatchSampler(train, config.batch_size, config.block_size, data_seed)
        eval_sampler = BatchSampler(val, config.batch_size, config.block_size, seed=1234)
        self.eval_set = [eval_sampler.next() for _ in range(config.eval_batches)]
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.inner_lr, weight_decay=config.weight_decay
        )
        self.client = AggregatorClient(config.server)
        self.progress = Progress(learner_id=config.learner_id)
        self.global_params: list[torch.Tensor] = []
        self.session_id = ""
        self.lease_s = 10.0  # replaced by the server's value at Join

    # -- the loop --------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> Progress:
        """Train until max_outer_steps, duration_s or `stop`; always leaves and closes."""
        cfg, started = self.config, time.monotonic()
        heartbeat_stop = threading.Event()
        try:
            self.client.wait_ready(cfg.connect_timeout_s)
            self._join()
            threading.Thread(target=self._heartbeat, args=(heartbeat_stop,), daemon=True).start()
            self._record_eval()
            while not stop.is_set():
                if cfg.max_outer_steps and self.progress.outer_steps >= cfg.max_outer_steps:
                    break
                if cfg.duration_s and time.monotonic() - started >= cfg.duration_s:
                    break
                if not self._inner_steps(stop):
                    break
                self._sync(stop)
        finally:
            heartbeat_stop.set()
            self._leave()
            self.progress.bytes_sent = self.client.bytes_sent
            self.progress.bytes_received = self.client.bytes_received
            self.client.close()
        return self.progress

    def _inner_steps(self, stop: threading.Event) -> bool:
        """H steps of AdamW on local data; False if stopped part way (the work is dropped)."""
        self.model.train()
        t0 = time.perf_counter()
        for _ in range(self.config.sync_every_steps):
            if stop.is_set():
                return False
            x, y = self.batches.next()
            _, loss = self.model(x, y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.progress.inner_steps += 1
            self.progress.tokens += x.numel()
            self.progress.last_loss = loss.item()
        self.progress.compute_s += time.perf_counter() - t0
        return True

    def _sync(self, stop: threading.Event) -> None:
        """Push this round's pseudo-gradient, wait for the round to close, load the result."""
        t0 = time.perf_counter()
        with torch.no_grad():
            deltas = [
                g - p.detach().cpu() for g, p in zip(self.global_params, self.params, strict=True)
            ]
        header = pb.PushHeader(
            session_id=self.session_id,
            fragment_id=0,
            base_version=self.progress.version,
            inner_steps=self.config.sync_every_steps,
            tokens=self.config.sync_every_steps * self.config.batch_size * self.config.block_size,
            kind=pb.PUSH_KIND_DELTA,
        )
        try:
            reply = self.client.push(header, encode_fragment(deltas, self.config.push_codec))
            target = reply.round_version
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:  # our lease expired: join again
                log.warning(
                    "learner=%s session lost (%s); rejoining", self.config.learner_id, err.details()
                )
                self._join()
                return
            if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            # Stale: the round closed without us. Our update is lost; take the new state.
            self.progress.stale_pushes += 1
            log.warning("learner=%s push rejected: %s", self.config.learner_id, err.details())
            target = self.progress.version + 1
        while not stop.is_set() and self.progress.version < target:
            self._pull(wait_for_version=target)
        self.progress.blocked_on_sync_s += time.perf_counter() - t0
        self.progress.outer_steps += 1
        self._record_eval()

    # -- protocol steps --------------------------------------------------------------------

    def _join(self) -> None:
        reply = self.client.join(self.config.learner_id, self.fingerprint)
        self.session_id, self.lease_s = reply.session_id, reply.lease_s
        log.info(
            "learner=%s joined epoch=%d mode=%s version=%d",
            self.config.learner_id,
            reply.server_epoch,
            reply.mode,
            reply.fragments[0].version,
        )
        if reply.fragments[0].version < 0:
            self._offer_initial_params()
        self.progress.version = -1
        while self.progress.version < 0:
            self._pull(wait_for_version=0)

    def _offer_initial_params(self) -> None:
        header = pb.PushHeader(
            session_id=self.session_id, fragment_id=0, base_version=-1, kind=pb.PUSH_KIND_INITIAL
        )
        try:
            self.client.push(header, encode_fragment(self.params, "fp32"))
            log.info("learner=%s initialized the global parameters", self.config.learner_id)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise  # another learner was first otherwise: fine, we pull theirs

    def _pull(self, wait_for_version: int) -> None:
        header, payload = self.client.pull(
            self.session_id, 0, self.progress.version, wait_for_version, PULL_WAIT_S
        )
        if header.kind != pb.PULL_KIND_SNAPSHOT:
            return
        tensors = decode_fragment(payload, self.shapes)
        crc = params_crc32(tensors)
        if crc != header.params_crc32:
            raise RuntimeError(f"replica checksum {crc:#x} != server's {header.params_crc32:#x}")
        with torch.no_grad():
            for p, g in zip(self.params, tensors, strict=True):
                p.copy_(g)
        self.global_params = tensors
        self.progress.version = header.version
        self.progress.params_crc32 = crc

    def _heartbeat(self, stop: threading.Event) -> None:
        while not stop.wait(self.lease_s / 3):
            request = pb.HeartbeatRequest(
                session_id=self.session_id,
                step=self.progress.inner_steps,
                tokens=self.progress.tokens,
                loss=self.progress.last_loss,
            )
            try:
                self.client.heartbeat(request)
            except grpc.RpcError as err:
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
        self.model.eval()
        with torch.no_grad():
            losses = [self.model(x, y)[1].item() for x, y in self.eval_set]
        loss = sum(losses) / len(losses)
        self.progress.eval_losses.append(loss)
        p = self.progress
        log.info(
            "learner=%s outer_step=%d version=%d eval_loss=%.4f train_loss=%.4f tokens=%d "
            "sent_bytes=%d received_bytes=%d",
            p.learner_id,
            p.outer_steps,
            p.version,
            loss,
            p.last_loss,
            p.tokens,
            self.client.bytes_sent,
            self.client.bytes_received,
        )

    def save_params(self, path: str) -> None:
        torch.save({n: p.detach().cpu().clone() for n, p in self.model.named_parameters()}, path)


def _load_corpus(config: LearnerConfig) -> tuple[torch.Tensor, torch.Tensor]:
    if config.corpus == "stdlib":
        return load_text_corpus(stdlib_dir(), config.corpus_max_bytes)
    path = Path(config.corpus)
    if path.suffix == ".bin":
        return load_token_file(path, config.vocab_size)
    return load_text_corpus(path, config.corpus_max_bytes)


def _stable_hash(text: str) -> int:
    return zlib.crc32(text.encode())
