"""Settings from a TOML file, `DILOCO_*` environment variables and flags, declared once.

A daemon's config is a `@dataclass(kw_only=True)` whose fields are small per-component
section dataclasses (connection, sync schedule, model, ...) and, rarely, plain values. Every
plain field anywhere in that tree (a "setting") has one name, unique across the sections, and
that name is its `--setting-name` flag (with the docstring written under the field as its
help, grouped by section), its environment variable `DILOCO_SETTING_NAME`, and its TOML key:
either at the top of the file given with `--config`, or inside the table of its section
(`[sync]` then `sync_every_steps = 50`). Precedence, lowest first: the field's default < the
config file < the environment < flags. Each section's `__post_init__` validates its own
fields and the daemon config checks what spans sections; a bad value, an unknown key or a
value of the wrong type ends in one `error:` line from argparse (exit code 2), never a
traceback. `build_config` makes a config from flat setting names in code and tests.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import os
import re
import textwrap
import tomllib
import typing
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")

ENV_PREFIX = "DILOCO_"
TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


@functools.cache  # parsed once per class: configs are built often, in threads too
def field_docs(cls: type) -> dict[str, str]:
    """The docstrings written under each field, for this class and its bases (do not
    modify the returned dict: it is shared)."""
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


@dataclasses.dataclass(frozen=True)
class Setting:
    """One plain field of a config tree: its name, type, default, help and where it lives."""

    name: str
    kind: type
    default: Any
    doc: str
    section: str  # the section field's name in the daemon config; "" for a top-level field


def settings(cls: type) -> dict[str, Setting]:
    """Every setting of the config class `cls`, by name, sections flattened (in order)."""
    found: dict[str, Setting] = {}
    hints, docs = _resolved_types(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if _is_section(kind):
            inner = [dataclasses.replace(s, section=f.name) for s in _plain_settings(kind)]
        else:
            inner = [Setting(f.name, kind, _default(f), docs.get(f.name, ""), "")]
        for setting in inner:
            if setting.name in found:
                raise TypeError(f"{cls.__name__}: setting {setting.name} is declared twice")
            found[setting.name] = setting
    return found


def sections(cls: type) -> dict[str, type]:
    """The section dataclasses of `cls`, by the name of the field that holds each."""
    hints = _resolved_types(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if _is_section(hints[f.name])}


def build_config(cls: type[T], values: Mapping[str, Any]) -> T:
    """A config from flat setting names (`{"sync_every_steps": 20}`), sections filled in.

    A class with a `recipe_values(values)` static method (a preset such as `recipe =
    "paper"`) gets that preset's settings under the given ones: what the caller sets wins.
    Raises ValueError naming an unknown setting, and whatever the sections' checks raise."""
    known = settings(cls)
    unknown = sorted(set(values) - set(known))
    if unknown:
        guess = did_you_mean(unknown[0], known) or f"; known: {', '.join(known)}"
        raise ValueError(f"unknown setting {unknown[0]!r} for {cls.__name__}{guess}")
    preset = getattr(cls, "recipe_values", None)
    if preset is not None:
        values = {**preset(values), **values}
    nested: dict[str, Any] = {}
    by_section: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        section = known[name].section
        if section:
            by_section.setdefault(section, {})[name] = value
        else:
            nested[name] = value
    for name, kind in sections(cls).items():
        nested[name] = kind(**by_section.get(name, {}))
    return cls(**nested)


def flat_values(config: Any) -> dict[str, Any]:
    """The inverse of build_config: every setting of `config` by its flat name."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if _is_section(type(value)):
            values.update({g.name: getattr(value, g.name) for g in dataclasses.fields(value)})
        else:
            values[f.name] = value
    return values


def add_config_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add `--config` and one flag per setting of `cls`, with its docstring, grouped by
    section (a section's own docstring is the group's description).

    Flags left out stay absent from the parsed namespace, so the file and the environment
    can supply them.
    """
    parser.add_argument(
        "--config",
        metavar="FILE",
        help=f"TOML file of settings (keys as below, with underscores, at the top or in their "
        f"section's table); {ENV_PREFIX}* environment variables override it and flags override "
        "both",
    )
    groups = {
        name: parser.add_argument_group(name, inspect.getdoc(kind))
        for name, kind in sections(cls).items()
    }
    for s in settings(cls).values():
        target = groups.get(s.section, parser)
        flag = "--" + s.name.replace("_", "-")
        help_text = f"{s.doc} [{env_name(s.name)}] (default: {s.default})"
        kind = (
            {"action": argparse.BooleanOptionalAction}
            if s.kind is bool
            else {"type": s.kind, "metavar": s.name.upper()}
        )
        target.add_argument(flag, default=argparse.SUPPRESS, help=help_text, **kind)


def reference(daemons: Mapping[str, type]) -> str:
    """The configuration reference in Markdown, made from the settings' own docs: for each
    daemon (its command, its config class), a table per section of every setting's TOML key
    (= its flag and DILOCO_* variable), default and docstring. docs/configuration.md is this
    text (`python -m common.config`); a test keeps it current."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from the settings' own docs by `.venv/bin/python -m common.config` (do not",
        "edit by hand). Every setting has one name: its TOML key (at the top of the file given",
        "with `--config`, or in its section's table), its flag (`--name-with-dashes`) and its",
        f"environment variable (`{ENV_PREFIX}NAME`). Precedence, lowest first: the default <",
        "the config file < the environment < flags.",
    ]
    for command, cls in daemons.items():
        notes = cls.restart_notes() if hasattr(cls, "restart_notes") else {}
        lines += ["", f"## {command}"]
        by_section: dict[str, list[Setting]] = {}
        for setting in settings(cls).values():
            by_section.setdefault(setting.section, []).append(setting)
        kinds = sections(cls)
        for section, members in by_section.items():
            title = f"`[{section}]`" if section else "top level"
            about = " ".join((inspect.getdoc(kinds[section]) or "").split()) if section else ""
            lines += ["", f"### {title}", ""] + ([about, ""] if about else [])
            lines += ["| setting | default | what it does |", "| --- | --- | --- |"]
            for s in members:
                default = "" if s.default in ("", None) else f"`{s.default!r}`"
                doc = f"{s.doc} {notes[s.name]}" if s.name in notes else s.doc
                lines.append(f"| `{s.name}` | {default} | {doc.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a bad flag ends in one line, like a bad TOML or environment value: the
    daemons have dozens of flags, and their usage would bury the error."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments: --"):  # argparse's wording
            flag = message.split()[2].split("=")[0]
            message += did_you_mean(flag, self._option_string_actions)
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def config_parser(prog: str, description: str, cls: type) -> argparse.ArgumentParser:
    """A daemon's command line: every setting of `cls` as a flag, plus --config."""
    parser = OneLineErrorParser(prog=prog, description=description)
    add_config_flags(parser, cls)
    return parser


def parse_command_line(
    parser: argparse.ArgumentParser,
    cls: type[T],
    argv: list[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> T:
    """The config of `cls` from `argv` (default: sys.argv), `environ` (default: os.environ)
    and the --config file; a bad value exits with one line (see config_from_args)."""
    return config_from_args(parser, cls, parser.parse_args(argv), environ)


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
    environ = os.environ if environ is None else environ
    try:
        values = resolve_values(cls, getattr(args, "config", None), environ)
        known = settings(cls)
        flags = {k: v for k, v in vars(args).items() if k in known}
        values.update(flags)
        try:
            return build_config(cls, values)
        except ValueError as err:
            raise ValueError(_from_environment(str(err), set(known) - set(flags), environ)) from err
    except ValueError as err:
        # One line, without the usage text: the value is wrong, not the command's syntax.
        parser.exit(2, f"{parser.prog}: error: {err}\n")


def _from_environment(message: str, names: set[str], environ: Mapping[str, str]) -> str:
    """`message` (a section's check refusing a value), led by the DILOCO_* variable that set
    the setting it names: a user who exported it long ago would look for it elsewhere."""
    for name in sorted(names, key=len, reverse=True):  # outer_lr_x before outer_lr
        var = env_name(name)
        if var in environ and re.search(rf"\b{name}\b", message):
            return f"{var}={environ[var]!r}: {message}"
    return message


def resolve_values(cls: type, config_file: str | None, environ: Mapping[str, str]) -> dict:
    """Setting values from the TOML file, then the environment on top (flags come later)."""
    known = settings(cls)
    values: dict[str, Any] = {}
    if config_file:
        values.update(load_toml(config_file, known, set(sections(cls))))
    for name, setting in known.items():
        var = env_name(name)
        if var in environ:
            values[name] = _parse_env(var, environ[var], setting)
    return values


def load_toml(
    path: str, known: Mapping[str, Setting], section_names: set[str] = frozenset()
) -> dict[str, Any]:
    """The file's settings, flat, each checked to be a known setting of the right type and,
    inside a section's table, to belong to that section."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as err:
        raise ValueError(f"cannot read config file {path}: {err.strerror}") from err
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"config file {path} is not valid TOML: {err}") from err
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and key not in section_names and key not in known:
            listed = "; the sections are " + ", ".join(f"[{n}]" for n in sorted(section_names))
            guess = did_you_mean(key, section_names, "[{}]") or listed
            raise ValueError(f"unknown section [{key}] in {path}{guess}")
        if key in section_names and isinstance(value, dict):
            for inner, inner_value in value.items():
                setting = _known_key(path, inner, known, f" in [{key}] of {path}")
                if setting.section != key:
                    raise ValueError(
                        f"config file {path}: {inner} belongs in [{setting.section}], not [{key}]"
                        if setting.section
                        else f"config file {path}: {inner} belongs at the top, not in [{key}]"
                    )
                flat[inner] = _checked(path, inner, inner_value, setting.kind)
        else:
            flat[key] = _checked(path, key, value, _known_key(path, key, known, f" in {path}").kind)
    return flat


def _known_key(path: str, key: str, known: Mapping[str, Setting], where: str) -> Setting:
    if key not in known:
        raise ValueError(f"unknown setting {key!r}{where}{did_you_mean(key, known)}")
    return known[key]


def did_you_mean(name: str, candidates: Iterable[str], form: str = "{!r}") -> str:
    """'; did you mean X?' for the candidate nearest to `name`, or '' when none is near."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.75)
    return f"; did you mean {form.format(close[0])}?" if close else ""


def _checked(path: str, key: str, value: Any, kind: type) -> Any:
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise ValueError(f"config file {path}: {key} must be {TYPE_NAMES[kind]}, got {value!r}")
    return value


def _parse_env(var: str, text: str, setting: Setting) -> Any:
    kind = setting.kind
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
    raise ValueError(f"{var}={text!r}: {setting.name} must be {TYPE_NAMES[kind]}")


def _plain_settings(section: type) -> list[Setting]:
    hints, docs = _resolved_types(section), field_docs(section)
    return [
        Setting(f.name, hints[f.name], _default(f), docs.get(f.name, ""), "")
        for f in dataclasses.fields(section)
    ]


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _is_section(kind: Any) -> bool:
    return isinstance(kind, type) and dataclasses.is_dataclass(kind)


@functools.cache
def _resolved_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    for name, hint in hints.items():
        # `str | None` style optionals: take the non-None member.
        args = getattr(hint, "__args__", None)
        if args and type(None) in args:
            hints[name] = next(a for a in args if a is not type(None))
    return hints


def address_list(text: str, setting: str) -> list[str]:
    """The host:port addresses of a comma-separated setting, in order; ValueError naming
    the setting for an entry that is not host:port."""
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    for address in addresses:
        if ":" not in address:
            raise ValueError(f"{setting} must be host:port, got {address!r}")
    return addresses


def daemons() -> dict[str, type]:
    """The daemons whose settings the reference lists (imported here: they import this)."""
    from learner.config import LearnerConfig
    from server.config import ServerConfig

    return {"diloco-server": ServerConfig, "diloco-learner": LearnerConfig}


if __name__ == "__main__":
    import pathlib
    import sys

    target = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "docs/configuration.md")
    target.write_text(reference(daemons()))
    print(f"wrote {target}")
