"""A config dataclass's fields as command-line flags: the one way the trainer (research.config)
and the benchmarks (experiments.bench) turn a dataclass into argparse flags.

A field's annotation gives its flag (`field_type`): int, float, str or bool; `X | None`;
`tuple[X, ...]` (one or more values); `Literal[...]` (its values are the choices). Its help
and the values it allows beyond its type (a `Rule`) are given once, where the field is
declared (`arg`), or by the caller (`about`).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, TypeVar

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class FieldType:
    """What a field's annotation says: its base type, whether None is allowed, its choices
    (a Literal's values) and whether it takes several values (a tuple)."""

    kind: type
    optional: bool = False
    choices: tuple = ()
    many: bool = False


def field_type(hint: Any) -> FieldType:
    """The `FieldType` of annotation `hint`."""
    args = typing.get_args(hint)
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        (hint,) = (a for a in args if a is not type(None))
    many = typing.get_origin(hint) is tuple
    if many:
        hint = typing.get_args(hint)[0]
    choices = typing.get_args(hint) if typing.get_origin(hint) is Literal else ()
    return FieldType(type(choices[0]) if choices else hint, optional, choices, many)


def field_types(cls: type) -> dict[str, FieldType]:
    """Field name -> `FieldType`, for the dataclass `cls`."""
    hints = typing.get_type_hints(cls)
    return {f.name: field_type(hints[f.name]) for f in dataclasses.fields(cls)}


def default_of(f: dataclasses.Field) -> Any:
    """The default of field `f` (its factory called when it has one)."""
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class Rule:
    """The values a field allows beyond its type, as a test and as words ("at least 1")."""

    allows: Callable[[Any], bool]
    text: str


def one_of(*choices: Any) -> Rule:
    """The rule allowing exactly `choices`."""
    return Rule(lambda v: v in choices, "one of " + ", ".join(map(str, choices)))


def about(help: str = "", rule: Rule | None = None, **flag: Any) -> dict[str, Any]:
    """What a field's flag says beyond its type: its help, its `rule` (checked by
    research.config; None: any value of the type) and further `add_argument` keywords
    (`choices`, `metavar`)."""
    return {"help": help, "rule": rule, "flag": flag}


def arg(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    factory: Callable[[], Any] | None = None,
    rule: Rule | None = None,
    **flag: Any,
) -> Any:
    """A config dataclass field that is also a flag: its default (or a `factory` computing it
    when needed) and, as its metadata, what `about` says of the flag."""
    metadata = about(help, rule, **flag)
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written; after a flag's help its default as one would type it
    (none shown for None, or for a flag without a value other than `--x/--no-x`)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        switch = action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)
        if default is None or default is argparse.SUPPRESS or switch or not action.help or "%(default)" in action.help:
            return action.help
        shown = " ".join(map(str, default)) if isinstance(default, tuple | list) else str(default)
        return f"{action.help} (default: {shown.replace('%', '%%')})"


def config_parser(cls: type, description: str | None) -> argparse.ArgumentParser:
    """A parser with a typed flag `--field-name` per field of the dataclass `cls`, declared with
    `arg` (bool: `--flag`, or `--flag/--no-flag` when it defaults to true). The caller adds its
    other flags to it."""
    p = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    types_of = field_types(cls)
    for f in dataclasses.fields(cls):
        kind, default = types_of[f.name], default_of(f)
        kwargs: dict[str, Any] = {"default": default, "help": f.metadata.get("help", ""), **f.metadata.get("flag", {})}
        if kind.many:
            kwargs["nargs"] = "+"
        if kind.choices:
            kwargs.setdefault("choices", kind.choices)
        if kind.kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction if default else "store_true"
        else:
            kwargs["type"] = kind.kind
        p.add_argument(flag_name(f.name), **kwargs)
    return p


def config_from(cls: type[T], args: argparse.Namespace) -> T:
    """The dataclass `cls` with the values parsed by `config_parser(cls, ...)` (several values
    as a tuple)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})  # type: ignore[call-arg]
