"""Command-line flags generated from config dataclasses, so each setting is declared once.

Every field of a `@dataclass(kw_only=True)` config becomes a `--field-name` flag whose help is
the docstring written under the field. The dataclass's `__post_init__` validates; a ValueError
it raises becomes one `error:` line from argparse, never a traceback.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import typing
from typing import Any, TypeVar

T = TypeVar("T")


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
    """Add one flag per field of the dataclass `cls`, with its default and docstring."""
    docs = field_docs(cls)
    hints = _resolved_types(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        kind = hints[f.name]
        help_text = f"{docs.get(f.name, '')} (default: {default})"
        if kind is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
        else:
            parser.add_argument(
                flag, type=kind, default=default, help=help_text, metavar=f.name.upper()
            )


def config_from_args(parser: argparse.ArgumentParser, cls: type[T], args: argparse.Namespace) -> T:
    """Build and validate the config; a bad value exits through parser.error (one line)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
    try:
        return cls(**values)
    except ValueError as err:
        parser.error(str(err))
        raise  # unreachable: parser.error exits


def _resolved_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    for name, hint in hints.items():
        # `str | None` style optionals: take the non-None member.
        args = getattr(hint, "__args__", None)
        if args and type(None) in args:
            hints[name] = next(a for a in args if a is not type(None))
    return hints
