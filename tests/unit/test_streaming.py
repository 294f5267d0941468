"""The Streaming DiLoCo schedule, the merge rule, and StreamingSync over a fake transport."""

import concurrent.futures

import pytest
import torch

from common.codec.fragment import decode_fragment, encode_fragment, params_crc32
from common.codec.sparse import kept_total
from common.generated.diloco.v1 import aggregator_pb2 as pb
from learner.streaming import FragmentReplica, PullReply, Schedule, StreamingSync, merge


def pushes(schedule: Schedule, steps: int) -> dict[int, list[int]]:
    """{step: fragments pushed} over the first `steps` steps."""
    return {t: schedule.pushes_at(t) for t in range(1, steps + 1) if schedule.pushes_at(t)}


def test_single_fragment_syncs_every_h_steps() -> None:
    assert pushes(Schedule(5), 16) == {5: [0], 10: [0], 15: [0]}


def test_fragments_are_staggered_by_h_over_p() -> None:
    # H = 12, P = 4: offsets 0, 3, 6, 9; fragment 0 first after a full H.
    assert pushes(Schedule(12, 4), 24) == {
        3: [1],
        6: [2],
        9: [3],
        12: [0],
        15: [1],
        18: [2],
        21: [3],
        24: [0],
    }


def test_every_fragment_syncs_once_per_h_in_steady_state() -> None:
    for h, p in [(10, 3), (50, 4), (7, 7)]:
        window = pushes(Schedule(h, p), 10 * h)
        counts = [sum(f in fs for t, fs in window.items() if t > h) for f in range(p)]
        assert counts == [9] * p, (h, p)


@pytest.mark.parametrize("tau", [0, 1, 3])
def test_merges_come_tau_steps_after_pushes(tau: int) -> None:
    schedule = Schedule(8, 2, overlap_steps=tau)
    for t in range(1, 40):
        assert schedule.merges_at(t + tau) == schedule.pushes_at(t)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sync_every_steps": 0}, "sync_every_steps"),
        ({"sync_every_steps": 4, "fragments": 5}, "fragments must be between"),
        ({"sync_every_steps": 4, "overlap_steps": 4}, "overlap_steps"),
    ],
)
def test_bad_schedules_are_refused(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        Schedule(**kwargs)


def test_resume_step_puts_a_newcomer_in_phase() -> None:
    schedule = Schedule(12, 4)  # pushes: 3:[1] 6:[2] 9:[3] 12:[0] 15:[1] ...
    assert schedule.resume_step([0, 0, 0, 0]) == 0
    assert schedule.resume_step([0, 1, 0, 0]) == 3
    assert schedule.resume_step([1, 2, 1, 1]) == 15
    # From there, the newcomer's next pushes are the ones the others wait for.
    assert schedule.pushes_at(16) == [] and schedule.pushes_at(18) == [2]
    for p, v in enumerate([3, 3, 2, 2]):
        assert schedule.pushes_at(schedule.sync_step(p, v)).count(p) == 1


def test_merge_rule() -> None:
    local, global_ = [torch.tensor([1.0, 2.0])], [torch.tensor([3.0, 6.0])]
    merge(local, global_, alpha=0.5)
    assert local[0].tolist() == [2.0, 4.0]
    merge(local, global_, alpha=0.0)
    assert torch.equal(local[0], global_[0])
    merge(local, [torch.zeros(2)], alpha=1.0)
    assert torch.equal(local[0], global_[0])


class EchoTransport:
    """A server of one learner: the new global value is base − mean delta (outer lr 1)."""

    def __init__(self, replicas):
        self.replicas, self.log = replicas, []

    def start_sync(self, fragment_id, base_version, payload, tokens, inner_steps):
        self.log.append(("push", fragment_id, tokens))
        replica = self.replicas[fragment_id]
        deltas = decode_fragment(payload, replica.shapes)
        new = [g - d for g, d in zip(replica.params, deltas, strict=True)]
        return PullReply(
            pb.PULL_KIND_SNAPSHOT, base_version + 1, encode_fragment(new, "fp32"), params_crc32(new)
        )

    def finish_sync(self, handle):
        self.log.append(("merge", handle.version))
        return handle

    def ready(self, handle):
        return handle.version not in self.late_versions

    late_versions: set = set()


def test_streaming_sync_pushes_deltas_and_merges_after_tau() -> None:
    params = [torch.zeros(4), torch.zeros(3)]
    replicas = [FragmentReplica(0, [0], [(4,)]), FragmentReplica(1, [1], [(3,)])]
    for r in replicas:
        r.params, r.version = [torch.zeros(r.shapes[0])], 0
    transport = EchoTransport(replicas)
    sync = StreamingSync(
        params,
        replicas,
        Schedule(4, 2, overlap_steps=1),
        transport,
        push_codec="fp32",
        merge_alpha=0.5,
        tokens_per_step=10,
    )
    for step in range(1, 5):
        with torch.no_grad():
            for p in params:
                p.add_(1.0)  # "training" moves every parameter by +1 per step
        sync.push_phase(step)
        sync.merge_phase(step)
    # Fragment 1 pushed after step 2 (delta −2), merged after step 3: global 2, local 3 -> 2.5,
    # then local 3.5 after step 4.
    assert params[1].tolist() == [3.5] * 3
    assert replicas[1].version == 1 and replicas[1].params[0].tolist() == [2.0] * 3
    # Fragment 0 pushed after step 4 and not merged yet (τ = 1).
    assert params[0].tolist() == [4.0] * 4 and replicas[0].version == 0
    assert transport.log == [("push", 1, 20), ("merge", 1), ("push", 0, 40)]
    assert sync.stats.syncs == 1 and sync.stats.peak_sync_bytes > 0


class BackgroundEchoTransport(EchoTransport):
    """EchoTransport that runs a push's encoding itself, on a thread of its own."""

    encodes_in_background = True

    def __init__(self, replicas):
        super().__init__(replicas)
        self.given, self.pool = [], concurrent.futures.ThreadPoolExecutor(1)

    def start_sync(self, fragment_id, base_version, payload, tokens, inner_steps):
        self.given.append(callable(payload))

        def run():
            data = payload() if callable(payload) else payload
            reply = EchoTransport.start_sync(
                self, fragment_id, base_version, data, tokens, inner_steps
            )
            reply.push_bytes = len(data) if callable(payload) else 0
            return reply

        return self.pool.submit(run)

    def finish_sync(self, handle):
        return handle.result()

    def ready(self, handle):
        return handle.done()


@pytest.mark.parametrize("codec", ["fp32", "fp4_e2m1", "sparse_2bit"])
def test_a_dense_push_is_encoded_by_a_transport_that_offers_to(codec: str) -> None:
    """Same parameters and bytes whichever thread encodes; only a dense encoding (which keeps
    no state) is handed over."""
    results = {}
    for transport_type in (EchoTransport, BackgroundEchoTransport):
        params = [torch.zeros(64), torch.zeros(96)]
        replicas = [FragmentReplica(0, [0], [(64,)]), FragmentReplica(1, [1], [(96,)])]
        for r in replicas:
            r.params, r.version = [torch.zeros(r.shapes[0])], 0
        transport = transport_type(replicas)
        sync = StreamingSync(params, replicas, Schedule(4, 2), transport, push_codec=codec)
        for step in range(1, 13):
            with torch.no_grad():
                for i, p in enumerate(params):
                    p.add_(torch.linspace(-1, 1, p.numel()) * (step + i))
            sync.push_phase(step)
            sync.merge_phase(step)
        results[transport_type] = ([p.clone() for p in params], sync.stats.push_bytes)
        if transport_type is BackgroundEchoTransport:
            assert set(transport.given) == {codec != "sparse_2bit"}
    (local, sent), (local_bg, sent_bg) = results.values()
    assert all(torch.equal(a, b) for a, b in zip(local, local_bg, strict=True))
    assert sent == sent_bg > 0


def test_non_blocking_sync_keeps_training_and_merges_on_arrival() -> None:
    params = [torch.zeros(2)]
    replica = FragmentReplica(0, [0], [(2,)])
    replica.params, replica.version = [torch.zeros(2)], 0
    transport = EchoTransport([replica])
    transport.late_versions = {1}  # the first reply is slow
    sync = StreamingSync(
        params,
        [replica],
        Schedule(2, 1, overlap_steps=1),
        transport,
        push_codec="fp32",
        merge_alpha=0.0,
        blocking=False,
    )
    sync.push_phase(2)  # push at step 2, due after step 3
    assert sync.merge_phase(3) == [] and sync.in_flight() == [0]  # not back: no wait
    sync.push_phase(4)  # still out: skipped, not queued behind it
    assert sync.stats.skipped_pushes == 1
    transport.late_versions = set()
    assert sync.merge_phase(5) == [0]  # arrives: merged late
    assert sync.stats.late_merges == 1
    # One push, one merge: the skipped push never reached the transport.
    assert transport.log == [("push", 0, 0), ("merge", 1)]


def test_a_fragment_whose_shard_is_away_is_not_pushed_nor_waited_for() -> None:
    params = [torch.zeros(2), torch.zeros(2)]
    replicas = [FragmentReplica(f, [f], [(2,)]) for f in (0, 1)]
    for r in replicas:
        r.params, r.version = [torch.zeros(2)], 0
    transport = EchoTransport(replicas)
    away = {1}
    sync = StreamingSync(
        params,
        replicas,
        Schedule(2, 2, overlap_steps=1),
        transport,
        push_codec="fp32",
        tokens_per_step=10,
        blocking=True,  # sync mode: a merge would wait for a push that was sent
        away=lambda: away,
    )
    for step in range(1, 5):
        with torch.no_grad():
            for p in params:
                p.add_(1.0)
        sync.push_phase(step)
        sync.merge_phase(step)
    # Fragment 1 (due after steps 1 and 3) never reached the transport; fragment 0 synced.
    assert transport.log == [("push", 0, 20), ("merge", 1), ("push", 0, 20)]
    assert sync.stats.skipped_pushes == 2 and params[1].tolist() == [4.0, 4.0]
    sync.load_globals(keep={1})  # the end of a run with the shard still away
    assert params[0].tolist() == [2.0, 2.0] and params[1].tolist() == [4.0, 4.0]
    away.clear()  # its shard joined again, the local fragment kept: the push's delta
    sync.push_phase(5)  # holds all five steps, and so does its claim
    assert transport.log[-1] == ("push", 1, 50)


def test_a_rejoin_that_drops_the_local_fragment_claims_only_the_steps_after_it() -> None:
    params = [torch.zeros(2)]
    replica = FragmentReplica(0, [0], [(2,)])
    replica.params, replica.version = [torch.zeros(2)], 0
    transport = EchoTransport([replica])
    away = {0}
    sync = StreamingSync(
        params,
        [replica],
        Schedule(2, 1, overlap_steps=1),
        transport,
        push_codec="fp32",
        tokens_per_step=10,
        away=lambda: away,
    )
    for step in range(1, 5):
        with torch.no_grad():
            params[0].add_(1.0)
        sync.push_phase(step)
        sync.merge_phase(step)
    assert transport.log == [] and sync.stats.skipped_pushes == 2
    moved = FragmentReplica(0, [0], [(2,)])  # the run moved on while it was away
    moved.params, moved.version = [torch.full((2,), 9.0)], 3
    sync.replace(moved, keep_local=False)
    away.clear()
    assert params[0].tolist() == [9.0, 9.0]
    for step in (5, 6):
        with torch.no_grad():
            params[0].add_(1.0)
        sync.push_phase(step)
    assert transport.log == [("push", 0, 20)]  # steps 5 and 6 only, not the dropped four


def test_a_learner_starting_mid_schedule_claims_only_its_own_steps() -> None:
    params = [torch.zeros(2)]
    replica = FragmentReplica(0, [0], [(2,)])
    replica.params, replica.version = [torch.zeros(2)], 7
    transport = EchoTransport([replica])
    sync = StreamingSync(
        params,
        [replica],
        Schedule(5),
        transport,
        push_codec="fp32",
        tokens_per_step=10,
        start_step=35,
    )
    sync.push_phase(40)
    assert transport.log == [("push", 0, 50)]  # 5 steps, not 40


def test_status_lines_are_rate_limited() -> None:
    from learner.trainer import _StatusClock

    clock = _StatusClock()
    rate, _ = clock.due(10.0, tokens=100, syncs=0)
    assert rate is not None  # the first line is always due
    assert clock.due(10.0, tokens=200, syncs=1)[0] is None  # 10 s have not passed
    clock.last_s -= 10.0  # as if 10 s had passed
    rate, since_sync = clock.due(10.0, tokens=300, syncs=1)
    assert rate is not None and 19.0 < rate <= 20.0  # 200 tokens in ~10 s
    assert since_sync < 1.0  # the sync count changed at the previous call
    assert clock.due(0.0, tokens=300, syncs=1)[0] is not None  # 0: every outer step


def test_a_faster_schedule_reports_real_inner_steps() -> None:
    # Dynamic local updates: the schedule runs 2 steps per inner step; a push after schedule
    # step 10 (H = 10) carries the 5 inner steps the learner really took.
    params = [torch.zeros(2)]
    replica = FragmentReplica(0, [0], [(2,)])
    replica.params, replica.version = [torch.zeros(2)], 0
    transport = EchoTransport([replica])
    sync = StreamingSync(
        params, [replica], Schedule(10), transport, push_codec="fp32", tokens_per_step=10
    )
    for inner in range(1, 6):
        for step in (2 * inner - 1, 2 * inner):
            sync.push_phase(step, inner_step=inner)
    assert transport.log == [("push", 0, 50)]


class RecordingTransport:
    """Keeps every push's decoded pseudo-gradient; the server never moves."""

    def __init__(self, replicas):
        self.replicas, self.pushed, self.payload_bytes = replicas, [], []

    def start_sync(self, fragment_id, base_version, payload, tokens, inner_steps):
        self.pushed.append(decode_fragment(payload, self.replicas[fragment_id].shapes))
        self.payload_bytes.append(len(payload))
        return PullReply(pb.PULL_KIND_UP_TO_DATE, base_version, b"", 0)

    def finish_sync(self, handle):
        return handle

    def ready(self, handle):
        return True


def sparse_learner(in_model: bool, shape: tuple[int, int], merge_alpha=0.0, decay=0.9):
    """One fragment of `shape` pushed in sparse_2bit (1/32) every step to a server that
    never moves."""
    params = [torch.zeros(shape)]
    replica = FragmentReplica(0, [0], [shape])
    replica.params, replica.version = [torch.zeros(shape)], 0
    transport = RecordingTransport([replica])
    sync = StreamingSync(
        params, [replica], Schedule(1), transport, "sparse_2bit", merge_alpha=merge_alpha,
        push_topk_fraction=1 / 32, push_feedback_decay=decay, push_feedback_in_model=in_model,
    )  # fmt: skip
    return params, replica, transport, sync


def test_sparse_pushes_carry_what_earlier_pushes_left_out() -> None:
    """Residual apart from the model: each push sends S(Δ + e) and keeps e ← Δ + e − S(Δ + e);
    over the pushes, what was sent plus what is held equals the sum of the pseudo-gradients."""
    shape = (3, 5000)
    params, _, transport, sync = sparse_learner(False, shape, merge_alpha=1.0, decay=1.0)
    total = torch.zeros(shape, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    for step in range(1, 6):
        with torch.no_grad():
            params[0].copy_(torch.randn(shape, generator=gen))  # Δ = 0 − params
        total -= params[0].double()
        sync.push_phase(step)
        sync.merge_phase(step)
    assert [int((p[0] != 0).sum()) for p in transport.pushed] == [kept_total(15000, 128)] * 5
    sent = sum(p[0] for p in transport.pushed)
    (residual,) = sync.push_residuals[0]
    torch.testing.assert_close((sent + residual).double(), total, atol=1e-4, rtol=0)


def test_in_model_feedback_merges_towards_global_less_residual_and_sends_the_same() -> None:
    """The merge takes θ_global − β·e, so training goes on from the unsent progress; the next
    push's Δ holds β·e already, and what it sends is what the rule with the residual apart
    sends (S(β·e + Δ)): the same bytes and, but for rounding, the same values."""
    shape = (3, 5000)
    runs = {in_model: sparse_learner(in_model, shape) for in_model in (True, False)}
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 6):
        move = torch.randn(shape, generator=gen)  # the same "training" for both learners
        for in_model, (params, replica, _, sync) in runs.items():
            assert sync.push_feedback_in_model is in_model
            with torch.no_grad():
                params[0].add_(move)
            sync.push_phase(step)
            before = [e.clone() for e in sync.push_residuals[0]]
            sync.merge_phase(step)
            held = 0.9 * before[0] if in_model else torch.zeros(shape)
            assert torch.equal(params[0], replica.params[0] - held)
    (kept, _, in_model, _), (_, _, apart, _) = runs[True], runs[False]
    assert in_model.payload_bytes == apart.payload_bytes and len(apart.payload_bytes) == 5
    for a, b in zip(in_model.pushed, apart.pushed, strict=True):
        torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5)
    assert not torch.equal(kept[0], torch.zeros(shape))  # the model holds the unsent part


@pytest.mark.parametrize("in_model", [True, False])
def test_taking_the_global_value_drops_only_a_residual_the_model_held(in_model) -> None:
    """In the model, the residual goes with the local values it lived in (load_globals, a
    rejoin's replace); apart, it is the only copy of the unsent progress and stays. A rejoin
    that keeps the local values keeps the residual either way."""
    params, replica, _, sync = sparse_learner(in_model, (2, 4096))

    def push() -> None:
        with torch.no_grad():
            params[0].add_(torch.randn(2, 4096, generator=torch.Generator().manual_seed(2)))
        sync.push_phase(1)
        sync.merge_phase(1)
        assert 0 in sync.push_residuals

    push()
    sync.replace(replica, keep_local=True)
    assert 0 in sync.push_residuals
    sync.load_globals()
    assert torch.equal(params[0], replica.params[0]) and (0 in sync.push_residuals) != in_model
    push()
    sync.replace(replica, keep_local=False)
    assert torch.equal(params[0], replica.params[0]) and (0 in sync.push_residuals) != in_model
