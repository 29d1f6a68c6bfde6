"""Config field types, read from the dataclasses' annotations: one check for every source.

TOML files, flags, programmatic configs and the configs stored in snapshots all pass through
`check_value`, so `steps = true`, `precision = "fp8"` or `lr = inf` is refused the same way
wherever it comes from. `ConfigError` lives here (re-exported by `config`) so that this module
needs nothing from the config itself.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from typing import Any, Literal

__all__ = [
    "ConfigError",
    "check_types",
    "check_value",
    "coerce",
    "flag",
    "flag_value",
    "hints",
    "leaves",
    "matches",
    "overlay",
    "to_toml",
]

INT64 = 2**63  # every integer setting must fit a tensor / JSON int64


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the flag, the value and the fix."""


def flag(path: str) -> str:
    """The CLI flag for a dotted field path: `model.d_model` -> `--model.d-model`."""
    return "--" + path.replace("_", "-")


def flag_value(path: str, value: Any) -> str:
    """How to write `value` on the command line: `--model.no-bias`, `--optim.lr 0.002`."""
    if isinstance(value, bool):
        head, _, tail = flag(path)[2:].rpartition(".")
        return f"--{head + '.' if head else ''}{'' if value else 'no-'}{tail}"
    if isinstance(value, (tuple, list)):
        return " ".join([flag(path), *map(str, value)])
    return f"{flag(path)} {value}"


_HINTS: dict[type, dict[str, Any]] = {}


def hints(cls: type) -> dict[str, Any]:
    """Field name -> resolved annotation of dataclass `cls` (resolved once per class)."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _arms(hint: Any) -> tuple[Any, ...]:
    origin = typing.get_origin(hint)
    return typing.get_args(hint) if origin in (typing.Union, types.UnionType) else (hint,)


def matches(value: Any, hint: Any) -> bool:
    """True when `value` has type `hint` (bool is not an int here, an int is a float)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(matches(value, arm) for arm in typing.get_args(hint))
    if origin is Literal:
        return any(type(value) is type(a) and value == a for a in typing.get_args(hint))
    if origin is tuple:
        item = typing.get_args(hint)[0]
        return isinstance(value, (tuple, list)) and all(matches(v, item) for v in value)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint in (int, str):
        return isinstance(value, hint) and not isinstance(value, bool)
    return False  # a field type this module does not know: add it above


def describe(hint: Any) -> str:
    """The type in words, for messages: `an integer`, `one of 'fp32', 'bf16'`."""
    words = []
    for arm in _arms(hint):
        if typing.get_origin(arm) is Literal:
            words.append("one of " + ", ".join(repr(a) for a in typing.get_args(arm)))
        elif typing.get_origin(arm) is tuple:
            item = describe(typing.get_args(arm)[0])  # "an integer", "one of 'a', 'b'"
            if item.startswith(("a ", "an ")):
                words.append(f"a list of {item.split(' ', 1)[1]}s")
            else:
                words.append(f"a list of values from {item.removeprefix('one of ')}")
        else:
            names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
            words.append(names.get(arm, "nothing" if arm is type(None) else str(arm)))
    return " or ".join(words)


def _numbers_ok(value: Any) -> str | None:
    """Why a well-typed value is still unusable: a non-finite float, an int beyond int64."""
    for v in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(v, float) and not math.isfinite(v):
            return "it must be a finite number"
        if isinstance(v, int) and not -INT64 <= v < INT64:
            return "it must fit in 64 bits"
    return None


def check_value(value: Any, hint: Any) -> str | None:
    """None when `value` fits annotation `hint`; else what it must be, in words."""
    if not matches(value, hint):
        return f"it must be {describe(hint)}"
    return _numbers_ok(value)


def coerce(value: Any, hint: Any) -> Any:
    """A checked value in the field's own Python type (TOML lists -> tuples, ints -> floats)."""
    if isinstance(value, list):
        return tuple(value)
    if float in _arms(hint) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def check_types(obj: Any, prefix: str = "") -> None:
    """Raise ConfigError for the first field of dataclass `obj` (sections included) whose
    value does not fit its annotation; the message names the flag and the field's default."""
    for f in dataclasses.fields(obj):
        value, path = getattr(obj, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            check_types(value, path + ".")
            continue
        why = check_value(value, hints(type(obj))[f.name])
        if why is not None:
            default = f.default if f.default is not dataclasses.MISSING else None
            raise ConfigError(
                f"{flag(path)} {value!r} is invalid: {why}; try {flag_value(path, default)}"
            )


def leaves(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted field path -> value for every setting of dataclass `obj` (sections recursed)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.update(leaves(value, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = value
    return out


def _toml(value: Any) -> str:
    """`value` as TOML writes it, for messages."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(map(_toml, value)) + "]"
    return "{...}" if isinstance(value, dict) else repr(value)


def overlay(obj: Any, updates: dict[str, Any], prefix: str, source: str) -> Any:
    """A copy of dataclass `obj` with `updates` (a parsed TOML table from `source`) applied,
    each value type-checked against its field, sections recursed into."""
    names = [f.name for f in dataclasses.fields(obj)]
    changes: dict[str, Any] = {}
    for key, value in updates.items():
        name = key.replace("-", "_")
        if name not in names:
            near = difflib.get_close_matches(name, names, n=1)
            raise ConfigError(
                f"{source}: unknown setting '{prefix}{key}'; try "
                + (f"'{prefix}{near[0]}'" if near else "one of " + ", ".join(names))
            )
        current = getattr(obj, name)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{source}: '{prefix}{key}' is a section; try writing it as [{prefix}{key}]"
                )
            changes[name] = overlay(current, value, f"{prefix}{name}.", source)
            continue
        hint = hints(type(obj))[name]
        why = check_value(value, hint)
        if why is not None:
            section = f"[{prefix[:-1]}] " if prefix else ""
            fix = f"{section}{name} = {_toml(current)}" if current is not None else "removing it"
            shown = _toml(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise ConfigError(f"{source}: {prefix}{key} = {shown} is invalid: {why}; try {fix}")
        changes[name] = coerce(value, hint)
    return dataclasses.replace(obj, **changes)


def _toml_value(value: Any) -> str:
    """`value` as exact TOML (strings escaped as TOML basic strings, floats round-tripping)."""
    if isinstance(value, str):
        # JSON's escapes are TOML's; DEL is a control character TOML wants escaped too
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(map(_toml_value, value)) + "]"
    return _toml(value)


def to_toml(obj: Any, prefix: str = "") -> str:
    """Dataclass `obj` as TOML that `overlay` reads back to the same values. A None field is
    left out (TOML has no null) with a comment saying so: it keeps its default there."""
    lines, sections = [], []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            sections.append(f"\n[{prefix}{f.name}]\n" + to_toml(value, f"{prefix}{f.name}."))
        elif value is None:
            lines.append(f"# {f.name}: not set")
        else:
            lines.append(f"{f.name} = {_toml_value(value)}")
    return "".join(line + "\n" for line in lines) + "".join(sections)
