"""A learner killed with SIGKILL resumes from its checkpoint: step count, data position,
its place in the inner learning-rate schedule, and its timing figures."""

from __future__ import annotations

import json

import pytest

from common.lr_schedule import LrSchedule
from common.retry import wait_until
from learner.checkpoint import load_checkpoint
from tests.support.processes import learner_log

BATCH_SIZE = 4  # TINY_LEARNER_FLAGS
INNER_LR = 2e-3
# A cosine over 40 inner steps (10 of warm-up): its rate at the resumed step differs from
# the rate at the same number of steps counted from zero.
SCHEDULE = LrSchedule("cosine", steps=40, warmup_fraction=0.25)
SCHEDULE_FLAGS = ["--inner-lr", str(INNER_LR), "--lr-schedule", "cosine"]
SCHEDULE_FLAGS += ["--lr-schedule-steps", "40", "--lr-warmup-fraction", "0.25"]


def test_a_killed_learner_resumes_its_steps_and_data_position(
    start_service, start_learner, tmp_path
):
    service = start_service(lease_s=2.0)
    corpus = tmp_path / "corpus"  # a folder of text files, the user-data input
    corpus.mkdir()
    for i in range(60):
        (corpus / f"doc{i}.txt").write_text(" ".join(f"word{(i * j) % 97}" for j in range(400)))
    ckpt = tmp_path / "ckpt"
    flags = ["--corpus", str(corpus), "--checkpoint-dir", str(ckpt)]
    flags += ["--checkpoint-every-steps", "3"]
    flags += ["--checkpoint-every-s", "0", *SCHEDULE_FLAGS]
    first = start_learner(service.port, "first", "--learner-id", "r", *flags)

    def trained_12_steps() -> bool:
        assert first.poll() is None, learner_log(tmp_path, "first")
        saved = load_checkpoint(ckpt) if (ckpt / "checkpoint.pt").exists() else None
        return saved is not None and saved["progress"]["inner_steps"] >= 12

    # Bounded: the learner writes one every 3 steps once it trains.
    wait_until(trained_12_steps, 120, "a checkpoint after 12 steps", interval_s=0.1)
    first.kill()  # SIGKILL: no leave, no final checkpoint
    first.wait(timeout=10)
    saved = load_checkpoint(ckpt)  # the last one written before the kill
    steps, outer = saved["progress"]["inner_steps"], saved["progress"]["outer_steps"]
    position = saved["data"]["position"]
    assert steps >= 12 and outer >= 2 and position == steps * BATCH_SIZE
    saved_lr = saved["optimizer"]["param_groups"][0]["lr"]
    assert saved_lr == pytest.approx(INNER_LR * SCHEDULE.factor(steps))

    second = start_learner(
        service.port,
        "second",
        "--learner-id",
        "r",
        *flags,
        "--max-outer-steps",
        str(outer + 2),
        "--summary-file",
        str(tmp_path / "second.json"),
    )
    assert second.wait(timeout=120) == 0, learner_log(tmp_path, "second")
    summary = json.loads((tmp_path / "second.json").read_text())
    assert summary["resumed_at_inner_step"] == steps
    # The timing goes on from the checkpoint's: each counter grew, and the compute of all
    # steps fits in the training wall time of all (not only of those since the restart).
    for name in ("compute_s", "train_wall_s", "eval_s"):
        assert summary[name] > saved["progress"][name] > 0, name
    assert summary["compute_s"] <= summary["train_wall_s"] - summary["eval_s"]
    assert summary["outer_steps"] == outer + 2
    new_steps = summary["inner_steps"] - steps
    # The schedule goes on from the checkpoint's step count, not from the restart.
    assert summary["inner_lr"] == pytest.approx(INNER_LR * SCHEDULE.factor(summary["inner_steps"]))
    assert summary["inner_lr"] != pytest.approx(INNER_LR * SCHEDULE.factor(new_steps))
    assert 0 < new_steps <= 2 * 5 + 5  # two outer steps of H = 5, from the server's phase
    # Not a cold start: the data position carries on from the checkpoint's.
    assert summary["data_position"] == position + new_steps * BATCH_SIZE
    assert (
        summary["eval_losses"][: len(saved["progress"]["eval_losses"])]
        == (saved["progress"]["eval_losses"])
    )
    saved_versions = [f["version"] for f in saved["fragments"]]
    assert all(v > s for v, s in zip(summary["versions"], saved_versions, strict=True))
    log = learner_log(tmp_path, "second")
    assert f"resuming from checkpoint step={steps} data_position={position}" in log
    assert "resumed versions=" in log
    # It pulled only what changed since the saved versions: far less than a snapshot.
    snapshot_bytes = 4 * sum(t.numel() for t in saved["model"].values())
    pulled = int(log.split("resumed versions=")[1].split("pulled_bytes=")[1].split()[0])
    assert pulled < snapshot_bytes / 2
