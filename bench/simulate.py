"""Train K learners in one process against the real aggregator, or one data-parallel model.

The learners run the project's own code: learner/streaming.py's schedule and merge
(StreamingSync), common/codec/ on every payload, and server/aggregator.py's rounds, outer
Nesterov step, error feedback and update log. Only the network is replaced: an in-process
transport hands each payload to the Aggregator as the gRPC servicer would (check the header,
decode, push; pull what the learner's version needs). Lockstep: all K learners take inner
step t, then all push, then all merge, so a sync round closes exactly as with K processes
that run at the same speed.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from common.codec.fragment import decode_fragment
from common.codec.sparse import DEFAULT_FEEDBACK_DECAY, DEFAULT_FEEDBACK_IN_MODEL
from common.codec.tensor import is_sparse
from common.lr_schedule import LrSchedule
from learner.data import BatchSampler, load_corpus
from learner.model import GPT, GPTConfig
from learner.streaming import FragmentReplica, PullReply, Schedule, StreamingSync
from server.aggregator import Aggregator
from server.config import aggregator_config
from server.rounds.ingest import DenseBody
from server.state.params import ParamSpec


@dataclass(kw_only=True)
class Setup:
    """What every variant shares: model, data, learners, token budget."""

    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 4
    block_size: int = 128
    batch_size: int = 16
    learners: int = 4
    steps: int = 1000
    inner_lr: float = 1e-3
    weight_decay: float = 0.1
    eval_every: int = 100
    eval_batches: int = 32
    corpus_max_bytes: int = 4 << 20
    seed: int = 0  # model init and data order
    device: str = "cpu"  # where the models train; the aggregator always runs on the CPU
    # CUDA float32 matrix products on the tensor cores in TF32 (10-bit mantissa inputs,
    # float32 sums); off: full float32 products, as on the CPU.
    tf32: bool = False
    # Inner learning rate over the run: "constant", or "cosine" (linear warm-up over
    # warmup_fraction of the steps, then cosine decay to min_lr_ratio of inner_lr).
    lr_schedule: str = "constant"
    warmup_fraction: float = 0.05
    min_lr_ratio: float = 0.1

    def model_config(self) -> GPTConfig:
        return GPTConfig(
            n_layer=self.n_layer, n_embd=self.n_embd, n_head=self.n_head, block_size=self.block_size
        )


@dataclass(kw_only=True)
class Variant:
    """One training method. `kind` is "dp" (the baseline) or "diloco" (any DiLoCo flavour)."""

    name: str
    kind: str = "diloco"
    sync_every_steps: int = 10
    fragments: int = 1
    overlap_steps: int = 0
    merge_alpha: float = 0.0
    push_codec: str = "fp32"
    pull_codec: str = "fp32"
    topk_fraction: float = 0.0  # sparse codecs, both ways (0: the codec's default)
    push_feedback_decay: float = DEFAULT_FEEDBACK_DECAY  # sparse pushes' residual decay
    push_feedback_in_model: bool = DEFAULT_FEEDBACK_IN_MODEL  # sparse pushes' residual rule
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_momentum_warmup_rounds: int = 0  # linear warm-up of the outer momentum (0: off)
    outer_momentum_warmup_start: float = 0.5
    warm_start_fraction: float = 0.0  # of the steps, data-parallel before the learners split
    # More aggregator settings by flat name (mode, robust_merge, max_weight_ratio, ...).
    server: dict = field(default_factory=dict)
    # The last `adversaries` learners send their pseudo-gradient times adversary_scale and
    # claim (and declare at Join) adversary_token_factor times their tokens.
    adversaries: int = 0
    adversary_scale: float = -10.0
    adversary_token_factor: int = 100


@dataclass
class Result:
    variant: dict
    eval_loss: float
    curve: list[tuple[int, float]] = field(default_factory=list)  # (total tokens, eval loss)
    bytes_per_learner: int = 0  # sent + received, one learner, whole run
    push_bytes: int = 0  # of those, sent (the learner that moved the most)
    pull_bytes: int = 0  # and received
    syncs: int = 0  # full-parameter syncs of one learner (fragment syncs / P; DP: steps)
    numel: int = 0  # parameters of the model
    peak_sync_bytes: int = 0  # the most one learner moves in one sync event
    blocked_s: float = 0.0
    wall_s: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time for the run (wall_s grows with the load)


class InProcessTransport:
    """The servicer's path without the network: check header, decode, push; pull by version.

    An adversarial learner's transport scales each pseudo-gradient by `scale` and multiplies
    the tokens it claims by `token_factor`."""

    def __init__(
        self,
        aggregator: Aggregator,
        session_id: str,
        scale: float = 1.0,
        token_factor: int = 1,
        sparse: bool = False,
    ) -> None:
        self.aggregator, self.session_id = aggregator, session_id
        self.scale, self.token_factor, self.sparse = scale, token_factor, sparse

    def start_sync(
        self, fragment_id: int, base_version: int, payload: bytes, tokens: int, inner_steps: int
    ):
        shapes = self.aggregator.check_push(self.session_id, fragment_id, base_version)
        tensors = [t * self.scale for t in decode_fragment(payload, shapes)]
        tokens *= self.token_factor
        # A sparse push's values count as sent where not zero (server/sparse_mean.py).
        body = DenseBody(tensors, sparse=self.sparse)
        self.aggregator.push(self.session_id, fragment_id, base_version, body, tokens, inner_steps)
        return fragment_id, base_version

    def ready(self, handle) -> bool:
        return True  # lockstep: the round closed when the last learner pushed

    def finish_sync(self, handle) -> PullReply:
        fragment_id, base_version = handle
        result = self.aggregator.pull(self.session_id, fragment_id, base_version)
        if result.version <= base_version:
            raise RuntimeError(f"fragment {fragment_id} round did not close in lockstep")
        return PullReply(result.kind, result.version, result.payload, result.params_crc32)


def load_data(setup: Setup) -> tuple[torch.Tensor, torch.Tensor]:
    return load_corpus("stdlib", setup.corpus_max_bytes)  # the learners' built-in corpus


def run_variant(setup: Setup, variant: Variant, threads: int = 1) -> Result:
    torch.set_num_threads(threads)
    torch.backends.cuda.matmul.allow_tf32 = setup.tf32
    started, cpu_started = time.perf_counter(), time.process_time()
    train, val = load_data(setup)
    eval_set = BatchSampler(val, setup.batch_size, setup.block_size, seed=1234)
    eval_batches = [eval_set.next() for _ in range(setup.eval_batches)]
    torch.manual_seed(setup.seed)
    model = GPT(setup.model_config()).to(setup.device)
    if variant.kind == "dp":
        result = _run_data_parallel(setup, variant, model, train, eval_batches)
    else:
        result = _run_diloco(setup, variant, model, train, eval_batches)
    result.wall_s = time.perf_counter() - started
    result.cpu_s = time.process_time() - cpu_started
    return result


def evaluate(model: GPT, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    with torch.no_grad():
        device = next(model.parameters()).device
        losses = [model(x.to(device), y.to(device))[1].item() for x, y in batches]
    model.train()
    return sum(losses) / len(losses)


def lr_factor(setup: Setup, step: int) -> float:
    """The inner learning rate at `step` (1-based, counted over the whole run) / inner_lr."""
    schedule = LrSchedule(
        setup.lr_schedule,
        steps=setup.steps,
        warmup_fraction=setup.warmup_fraction,
        min_lr_ratio=setup.min_lr_ratio,
    )
    return schedule.factor(step)


def data_seed(setup: Setup) -> int:
    """The first sampler's seed; learner i uses this + i. `seed` moves data order and init."""
    return 1000 + 100 * setup.seed


def _optimizer(setup: Setup, model: GPT) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=setup.inner_lr, weight_decay=setup.weight_decay)


def _step(setup: Setup, step: int, model: GPT, optimizer: torch.optim.Optimizer, batch) -> None:
    device = next(model.parameters()).device
    for group in optimizer.param_groups:
        group["lr"] = setup.inner_lr * lr_factor(setup, step)
    _, loss = model(*(t.to(device) for t in batch))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def _run_data_parallel(setup, variant, model, train, eval_batches, steps=None) -> Result:
    """K learners averaging gradients every step == one model on a K-times larger batch.

    `steps` < setup.steps runs only the start of the schedule (a warm start)."""
    steps = setup.steps if steps is None else steps
    k = setup.learners
    sampler = BatchSampler(train, setup.batch_size * k, setup.block_size, seed=data_seed(setup))
    optimizer = _optimizer(setup, model)
    tokens_per_step = setup.batch_size * k * setup.block_size
    curve = [(0, evaluate(model, eval_batches))]
    for step in range(1, steps + 1):
        _step(setup, step, model, optimizer, sampler.next())
        if step % setup.eval_every == 0 or step == steps:
            curve.append((step * tokens_per_step, evaluate(model, eval_batches)))
    numel = sum(p.numel() for p in model.parameters())
    # Ring all-reduce of fp32 gradients: each learner sends and receives 2(K-1)/K of them.
    per_step = 2 * (2 * (k - 1) / k) * numel * 4
    return Result(
        asdict(variant),
        curve[-1][1],
        curve,
        int(per_step * steps),
        push_bytes=int(per_step * steps / 2),
        pull_bytes=int(per_step * steps / 2),
        syncs=steps,
        numel=numel,
        peak_sync_bytes=int(per_step),
    )


def _run_diloco(setup, variant, model, train, eval_batches) -> Result:
    k = setup.learners
    warm_steps = int(setup.steps * variant.warm_start_fraction)
    warm_cost = Result({}, 0.0)
    if warm_steps:
        # A short data-parallel start, as DiLoCo starts from a partly trained model.
        warm_variant = Variant(name="warm", kind="dp")
        warm_cost = _run_data_parallel(
            setup, warm_variant, model, train, eval_batches, steps=warm_steps
        )
    specs = [ParamSpec(n, tuple(p.shape), "float32") for n, p in model.named_parameters()]
    aggregator = Aggregator(
        aggregator_config(
            lease_s=1e9,
            fragments=variant.fragments,
            pull_codec=variant.pull_codec,
            outer_lr=variant.outer_lr,
            outer_momentum=variant.outer_momentum,
            outer_momentum_warmup_rounds=variant.outer_momentum_warmup_rounds,
            outer_momentum_warmup_start=variant.outer_momentum_warmup_start,
            # The guard compares a push with its fragment's recent pushes; during a learning
            # rate warm-up each round's pseudo-gradient is legitimately several times the last.
            # `server` may also set the pull's own top-k fraction. The outer state stays in
            # float32 (torch's SGD exactly) unless `server` says otherwise: every cached run
            # was made so, and a variant's cache key holds only what `server` sets.
            **{
                "max_norm_ratio": 0.0,
                "outer_state_dtype": "float32",
                **({"pull_topk_fraction": variant.topk_fraction} if variant.topk_fraction else {}),
                **variant.server,
            },
        )
    )
    tokens_per_step = setup.batch_size * setup.block_size
    honest = k - variant.adversaries
    factors = [1 if i < honest else variant.adversary_token_factor for i in range(k)]
    sessions = [
        aggregator.join(f"learner-{i}", specs, tokens_per_step * factors[i]).session_id
        for i in range(k)
    ]
    layout = aggregator.layout()
    params0 = [p.detach().cpu() for p in model.parameters()]
    for fid, indices, _ in layout:
        aggregator.initialize(sessions[0], fid, [params0[i] for i in indices])
    schedule = Schedule(variant.sync_every_steps, variant.fragments, variant.overlap_steps)
    learners = []
    for i, session in enumerate(sessions):
        replica_model = GPT(setup.model_config()).to(setup.device)
        replica_model.load_state_dict(model.state_dict())
        params = [p for _, p in replica_model.named_parameters()]
        replicas = []
        for fid, indices, _ in layout:
            replica = FragmentReplica(fid, indices, [tuple(params[j].shape) for j in indices])
            result = aggregator.pull(session, fid, -1)
            replica.apply(
                PullReply(result.kind, result.version, result.payload, result.params_crc32)
            )
            replicas.append(replica)
        sync = StreamingSync(
            params,
            replicas,
            schedule,
            InProcessTransport(
                aggregator,
                session,
                scale=1.0 if i < honest else variant.adversary_scale,
                token_factor=factors[i],
                sparse=is_sparse(variant.push_codec),
            ),
            variant.push_codec,
            variant.merge_alpha,
            tokens_per_step=tokens_per_step,
            **({"push_topk_fraction": variant.topk_fraction} if variant.topk_fraction else {}),
            push_feedback_decay=variant.push_feedback_decay,
            push_feedback_in_model=variant.push_feedback_in_model,
        )
        sync.load_globals()
        sampler = BatchSampler(train, setup.batch_size, setup.block_size, seed=data_seed(setup) + i)
        learners.append((replica_model, _optimizer(setup, replica_model), sampler, sync))
    eval_model = GPT(setup.model_config()).to(setup.device)
    eval_params = [p for _, p in eval_model.named_parameters()]

    def global_loss() -> float:
        with torch.no_grad():
            for fid, indices, _ in aggregator.layout():
                for j, g in zip(indices, aggregator.params(fid), strict=True):
                    eval_params[j].copy_(g)
        return evaluate(eval_model, eval_batches)

    tokens_per_step *= k
    warm = warm_steps  # these steps' tokens are already spent
    curve = [(warm * tokens_per_step, global_loss())]
    local_steps = setup.steps - warm
    for t in range(1, local_steps + 1):
        for replica_model, optimizer, sampler, _ in learners:
            _step(setup, warm + t, replica_model, optimizer, sampler.next())
        for *_, sync in learners:
            sync.push_phase(t)
        for *_, sync in learners:
            sync.merge_phase(t)
        if (warm + t) % setup.eval_every == 0 or t == local_steps:
            curve.append(((warm + t) * tokens_per_step, global_loss()))
    for t in range(local_steps + 1, local_steps + 1 + variant.overlap_steps):
        for *_, sync in learners:  # merge the syncs still in flight
            sync.merge_phase(t)
    final = global_loss()
    curve[-1] = (curve[-1][0], final)
    stats = [sync.stats for *_, sync in learners]
    most = max(stats, key=lambda s: s.push_bytes + s.pull_bytes)
    return Result(
        asdict(variant),
        final,
        curve,
        bytes_per_learner=most.push_bytes + most.pull_bytes + warm_cost.bytes_per_learner,
        push_bytes=most.push_bytes,
        pull_bytes=most.pull_bytes,
        syncs=most.syncs // variant.fragments,
        numel=sum(p.numel() for p in model.parameters()),
        peak_sync_bytes=max([s.peak_sync_bytes for s in stats] + [warm_cost.peak_sync_bytes]),
        blocked_s=max(s.blocked_s for s in stats),
    )
