"""The parameters a learner starts from, read from a file (`--init-params`).

    load_initial_params(model, "model.safetensors")

The file is what diloco-export or `--save-params` writes: a safetensors file, or torch.save of
a {name: tensor} dict. It seeds a run: the first learner to join hands the server its
parameters, so learners that start from an exported model carry a run over to a new server
or a new set of shards (docs/deploy.md). A server that already holds parameters keeps them,
and a learner with a checkpoint resumes from it without reading the file (trainer.py).

The file must hold exactly the model's parameters (named_parameters() names, shapes, floating
point, finite); anything else is one error naming what differs, and the model is left as it
was.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import safetensors
import safetensors.torch
import torch
from torch import nn

__all__ = ["load_initial_params", "read_params_file"]

_SHOWN = 5  # names or problems listed in an error; the rest counted
# What reading a file that is not a parameters file raises (torch.load: a bad zip is a
# RuntimeError, a pickle it refuses an UnpicklingError).
_UNREADABLE = (OSError, RuntimeError, EOFError, pickle.UnpicklingError, safetensors.SafetensorError)


def read_params_file(path: str) -> dict[str, torch.Tensor]:
    """The {name: tensor} dict in `path` (.safetensors by its suffix, else torch.save)."""
    file = Path(path)
    try:
        if file.suffix == ".safetensors":
            loaded = safetensors.torch.load_file(str(file))
        else:  # weights_only: a parameters file runs no code when it is read
            loaded = torch.load(file, map_location="cpu", weights_only=True)
    except _UNREADABLE as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"init_params {path}: cannot read it: {reason}") from err
    if not isinstance(loaded, dict) or not all(
        isinstance(name, str) and isinstance(value, torch.Tensor) for name, value in loaded.items()
    ):
        raise ValueError(
            f"init_params {path}: not a name -> tensor dict (diloco-export's output, or "
            "--save-params')"
        )
    return loaded


def load_initial_params(model: nn.Module, path: str) -> None:
    """Copy the parameters in `path` into `model`, all or none."""
    params = read_params_file(path)
    own = dict(model.named_parameters())
    problems = []
    missing = [name for name in own if name not in params]
    unexpected = [name for name in params if name not in own]
    if missing:
        problems.append(f"missing {_first(missing)}")
    if unexpected:
        problems.append(f"not in the model {_first(unexpected)}")
    for name, p in own.items():
        value = params.get(name)
        if value is None:
            continue
        if tuple(value.shape) != tuple(p.shape):
            problems.append(f"{name} has shape {list(value.shape)}, the model {list(p.shape)}")
        elif not value.is_floating_point():
            problems.append(f"{name} is {value.dtype}, not floating point")
        elif not bool(torch.isfinite(value).all()):
            problems.append(f"{name} holds NaN or infinite values")
    if problems:
        raise ValueError(f"init_params {path} does not fit the model: {_first(problems, '; ')}")
    with torch.no_grad():
        for name, p in own.items():
            p.copy_(params[name].to(p.dtype))


def _first(items: list[str], separator: str = ", ") -> str:
    """The first _SHOWN items joined, and how many more there are."""
    shown = separator.join(items[:_SHOWN])
    return shown + (f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")
