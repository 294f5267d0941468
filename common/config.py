"""Settings from a TOML file, `DILOCO_*` environment variables and flags, declared once.

Every field of a `@dataclass(kw_only=True)` config becomes a `--field-name` flag whose help is
the docstring written under the field, a key `field_name` of the TOML file given with
`--config`, and an environment variable `DILOCO_FIELD_NAME`. Precedence, lowest first:
the field's default < the config file < the environment < flags. The dataclass's
`__post_init__` validates; a bad value, an unknown key or a value of the wrong type ends in one
`error:` line from argparse (exit code 2), never a traceback.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import textwrap
import tomllib
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")

ENV_PREFIX = "DILOCO_"
TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def field_docs(cls: type) -> dict[str, str]:
    """The docstrings written under each field, for this class and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, after in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def add_config_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add `--config` and one flag per field of the dataclass `cls`, with its docstring.

    Flags left out stay absent from the parsed namespace, so the file and the environment
    can supply them.
    """
    parser.add_argument(
        "--config",
        metavar="FILE",
        help=f"TOML file of settings (keys as below, with underscores); {ENV_PREFIX}* "
        "environment variables override it and flags override both",
    )
    docs = field_docs(cls)
    hints = _resolved_types(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        kind = hints[f.name]
        help_text = f"{docs.get(f.name, '')} [{env_name(f.name)}] (default: {default})"
        if kind is bool:
            parser.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            parser.add_argument(
                flag,
                type=kind,
                default=argparse.SUPPRESS,
                help=help_text,
                metavar=f.name.upper(),
            )


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def config_from_args(
    parser: argparse.ArgumentParser,
    cls: type[T],
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
) -> T:
    """Build and validate the config from file, environment and flags; a bad value exits
    with one line on stderr and exit code 2."""
    try:
        values = resolve_values(
            cls, getattr(args, "config", None), os.environ if environ is None else environ
        )
        names = {f.name for f in dataclasses.fields(cls)}
        values.update({k: v for k, v in vars(args).items() if k in names})
        return cls(**values)
    except ValueError as err:
        # One line, without the usage text: the value is wrong, not the command's syntax.
        parser.exit(2, f"{parser.prog}: error: {err}\n")


def resolve_values(cls: type, config_file: str | None, environ: Mapping[str, str]) -> dict:
    """Field values from the TOML file, then the environment on top (flags come later)."""
    hints = _resolved_types(cls)
    values: dict[str, Any] = {}
    if config_file:
        values.update(load_toml(config_file, hints))
    for name, kind in hints.items():
        var = env_name(name)
        if var in environ:
            values[name] = _parse_env(var, environ[var], kind)
    return values


def load_toml(path: str, hints: Mapping[str, Any]) -> dict[str, Any]:
    """The file's settings, each checked to be a known field of the right type."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as err:
        raise ValueError(f"cannot read config file {path}: {err.strerror}") from err
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"config file {path} is not valid TOML: {err}") from err
    for key, value in data.items():
        if key not in hints:
            hint = f" (did you mean {key.replace('-', '_')}?)" if "-" in key else ""
            raise ValueError(f"config file {path}: unknown key {key!r}{hint}")
        kind = hints[key]
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            ok, data[key] = True, float(value)
        if not ok:
            raise ValueError(f"config file {path}: {key} must be {TYPE_NAMES[kind]}, got {value!r}")
    return data


def _parse_env(var: str, text: str, kind: type) -> Any:
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
    else:
        try:
            return kind(text)
        except ValueError:
            pass
    raise ValueError(f"environment variable {var} must be {TYPE_NAMES[kind]}, got {text!r}")


def _resolved_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    for name, hint in hints.items():
        # `str | None` style optionals: take the non-None member.
        args = getattr(hint, "__args__", None)
        if args and type(None) in args:
            hints[name] = next(a for a in args if a is not type(None))
    return hints
