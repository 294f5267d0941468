"""--init-params (learner/initial_params.py): a learner starts from the parameters in a file
diloco-export or --save-params wrote, in either format; a file that does not fit the model is
refused in one sentence naming what differs, and the model is left as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from learner.checkpoint import save_checkpoint
from learner.config import CheckpointConfig, LearnerConfig
from learner.initial_params import load_initial_params
from learner.main import parse_config
from learner.model import GPT, GPTConfig
from learner.trainer import initial_model

MODEL = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=64)


def model_params(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {n: p.detach().clone() for n, p in GPT(MODEL).named_parameters()}


def unchanged(model: GPT, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_the_model_takes_the_files_parameters(tmp_path: Path, suffix: str) -> None:
    saved = model_params(seed=1)
    path = tmp_path / f"model{suffix}"
    if suffix == ".safetensors":
        save_file(saved, str(path))
    else:
        torch.save(saved, path)
    model = GPT(MODEL)
    assert not unchanged(model, saved)  # a fresh model differs
    load_initial_params(model, str(path))
    assert unchanged(model, saved)
    # head.weight is tok_emb.weight (tied): one parameter, loaded once, still shared
    assert model.head.weight is model.tok_emb.weight


def mutate(params: dict[str, torch.Tensor], how: str) -> dict[str, torch.Tensor]:
    params = dict(params)
    first = next(iter(params))
    if how == "missing":
        del params[first]
    elif how == "unexpected":
        params["blocks.9.extra"] = torch.zeros(3)
    elif how == "shape":
        params[first] = torch.zeros(2, 2)
    elif how == "integer":
        params[first] = params[first].to(torch.int32)
    elif how == "nan":
        params[first] = params[first].clone()
        params[first].view(-1)[0] = float("nan")
    return params


@pytest.mark.parametrize(
    "how, message",
    [
        ("missing", "missing tok_emb.weight"),
        ("unexpected", "not in the model blocks.9.extra"),
        ("shape", "tok_emb.weight has shape [2, 2], the model [64, 16]"),
        ("integer", "tok_emb.weight is torch.int32, not floating point"),
        ("nan", "tok_emb.weight holds NaN or infinite values"),
    ],
)
def test_a_file_that_does_not_fit_is_refused_and_changes_nothing(
    tmp_path: Path, how: str, message: str
) -> None:
    path = tmp_path / "model.pt"
    torch.save(mutate(model_params(seed=1), how), path)
    model = GPT(MODEL)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError) as err:
        load_initial_params(model, str(path))
    assert str(err.value).startswith(f"init_params {path} does not fit the model: ")
    assert message in str(err.value)
    assert unchanged(model, before)


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("absent.pt", None, "cannot read it"),
        ("garbage.pt", b"not a torch file", "cannot read it"),
        ("garbage.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}", "cannot read it"),
        ("list.pt", [torch.zeros(2)], "not a name -> tensor dict"),
    ],
)
def test_an_unreadable_file_is_one_error(
    tmp_path: Path, name: str, content: object, message: str
) -> None:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        torch.save(content, path)
    with pytest.raises(ValueError, match=f"^init_params {path}: {message}"):
        load_initial_params(GPT(MODEL), str(path))


def test_the_flag_and_its_environment_variable() -> None:
    assert parse_config(["--init-params", "m.safetensors"]).checkpoint.init_params == (
        "m.safetensors"
    )
    environ = {"DILOCO_INIT_PARAMS": "m.pt"}
    assert parse_config([], environ).checkpoint.init_params == "m.pt"
    assert parse_config([]).checkpoint.init_params == ""


def learner_config(init_params: str, checkpoint_dir: Path) -> LearnerConfig:
    checkpoint = CheckpointConfig(init_params=init_params, checkpoint_dir=str(checkpoint_dir))
    return LearnerConfig(model=MODEL, checkpoint=checkpoint)


def test_the_learner_starts_from_the_file_when_it_has_no_checkpoint(tmp_path: Path) -> None:
    saved = model_params(seed=1)
    save_file(saved, str(tmp_path / "model.safetensors"))
    model = initial_model(learner_config(str(tmp_path / "model.safetensors"), tmp_path / "ckpt"))
    assert unchanged(model, saved)
    with pytest.raises(ValueError, match="cannot read it"):  # no checkpoint: the file must be there
        initial_model(learner_config(str(tmp_path / "gone.safetensors"), tmp_path / "ckpt"))


def test_a_checkpoint_means_the_file_is_not_read(tmp_path: Path) -> None:
    """A restart resumes from the checkpoint, so it must not need the first start's file."""
    save_checkpoint(tmp_path / "ckpt", {"format": 1})
    model = initial_model(learner_config(str(tmp_path / "gone.safetensors"), tmp_path / "ckpt"))
    assert isinstance(model, GPT)


def test_only_an_islands_rank_0_reads_the_file(tmp_path: Path) -> None:
    """The other ranks take rank 0's parameters at the start; the file may be on its host only."""
    config = learner_config(str(tmp_path / "on-rank-0s-host.safetensors"), tmp_path / "ckpt")
    assert isinstance(initial_model(config, is_leader=False), GPT)
    with pytest.raises(ValueError, match="cannot read it"):
        initial_model(config, is_leader=True)
