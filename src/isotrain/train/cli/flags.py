"""Command lines checked against the option dataclasses before tyro parses them, so that every
mistake is one line in the user's words: `--steps fifty is not an integer; try --steps 1000`,
`unknown option --stepz; did you mean --steps?`, `--input and --out are required`.

tyro stays the parser; this only reads the fields' annotations and defaults (the same ones
tyro reads) to name the flag, the bad value and a value that works.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

import tyro

from isotrain.train.config import ConfigError
from isotrain.train.fields import flag, flag_value

__all__ = ["Option", "check_argv", "options"]


@dataclass(frozen=True)
class Option:
    """One flag of a command: its dotted field path, annotation and current default."""

    path: str
    hint: Any
    default: Any  # dataclasses.MISSING when the flag is required
    switch: bool = False  # a bool: --name / --no-name, no value


def _plain(hint: Any) -> tuple[Any, ...]:
    """The arms of a union other than None (`int | None` -> (int,))."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(a for a in typing.get_args(hint) if a is not type(None))
    return (hint,)


def _is_positional(hint: Any) -> bool:
    return any(m is tyro.conf.Positional or "Positional" in repr(m) for m in _metadata(hint))


def _metadata(hint: Any) -> tuple[Any, ...]:
    return tuple(getattr(hint, "__metadata__", ()))


def options(cls: type, default: Any = None, prefix: str = "") -> tuple[dict[str, Option], bool]:
    """Every flag of dataclass `cls` (sections recursed into, `--no-X` for switches), and
    whether it takes a positional argument."""
    out: dict[str, Option] = {}
    positional = False
    types_ = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        hint, path = types_[f.name], prefix + f.name
        if default is not None:
            value = getattr(default, f.name)
        elif f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = dataclasses.MISSING
        plain = typing.get_args(hint)[0] if _metadata(hint) else hint
        if _is_positional(hint):
            positional = True
        elif dataclasses.is_dataclass(plain) and isinstance(plain, type):
            inner, _ = options(plain, value, path + ".")
            out.update(inner)
        elif plain is bool:
            on = Option(path, plain, value, switch=True)
            out[flag(path)] = on
            out[flag_value(path, False)] = on
        else:
            out[flag(path)] = Option(path, plain, value)
    return out, positional


def _fix(opt: Option) -> str:
    """A flag with a value that works: the default, else an example of the type."""
    value = opt.default
    if value is dataclasses.MISSING:  # required: name its metavar, as argparse does
        name = opt.path.rsplit(".", 1)[-1].upper()
        many = typing.get_origin(_plain(opt.hint)[0]) is tuple
        return f"{flag(opt.path)} {name}{' ...' if many else ''}"
    if value is None or value == ():
        arm = _plain(opt.hint)[0]
        if typing.get_origin(arm) is tuple:
            arm = typing.get_args(arm)[0]
        if typing.get_origin(arm) is Literal:
            value = typing.get_args(arm)[0]
        else:
            value = {int: 1, float: 0.5}.get(arm, "PATH")
    return flag_value(opt.path, value)


def _bad_value(opt: Option, word: str) -> str | None:
    """Why `word` is not a value of `opt` (None when it is one)."""
    arms = _plain(opt.hint)
    if word == "None" and len(arms) < len(typing.get_args(opt.hint) or (opt.hint,)):
        return None  # an Optional field: None switches it off
    for arm in arms:
        item = typing.get_args(arm)[0] if typing.get_origin(arm) is tuple else arm
        if typing.get_origin(item) is Literal:
            choices = [str(c) for c in typing.get_args(item)]
            if word in choices:
                return None
            return f"is not one of {', '.join(choices)}"
        if item is int:
            try:
                int(word)
                return None
            except ValueError:
                return "is not an integer"
        if item is float:
            try:
                float(word)
                return None
            except ValueError:
                return "is not a number"
        return None
    return None


def _unknown(word: str, table: dict[str, Option], prog: str) -> ConfigError:
    near = [f for f in table if f.endswith("." + word[2:])]  # --lr: --optim.lr
    near = near if len(near) == 1 else difflib.get_close_matches(word, list(table), 1, 0.75)
    hint = f"did you mean {near[0]}?" if near else f"try {prog} --help"
    return ConfigError(f"unknown option {word}; {hint}")


def check_argv(cls: type, argv: list[str], prog: str, *, default: Any = None) -> None:
    """Raise a one-line ConfigError for the first unknown flag, bad or missing value, stray
    word or missing required flag of `argv`; silent when tyro will accept it."""
    table, positional = options(cls, default)
    seen: set[str] = set()
    i = 0
    while i < len(argv):
        word = argv[i]
        name, eq, inline = word.partition("=") if word.startswith("--") else (word, "", "")
        i += 1
        if not name.startswith("-") or name == "-":
            if not positional:
                raise ConfigError(f"unexpected argument {word!r}; try {prog} --help")
            positional = False
            continue
        opt = table.get(name)
        if opt is None:
            raise _unknown(name, table, prog)
        seen.add(opt.path)
        if opt.switch:
            if eq:
                raise ConfigError(f"{name} takes no value; try {name} alone")
            continue
        values = [inline] if eq else []
        many = typing.get_origin(_plain(opt.hint)[0]) is tuple
        while not eq and i < len(argv) and not argv[i].startswith("--"):
            values.append(argv[i])
            i += 1
            if not many:
                break
        if not values and not many:
            raise ConfigError(f"{name} needs a value; try {_fix(opt)}")
        for value in values:
            why = _bad_value(opt, value)
            if why is not None:
                raise ConfigError(f"{name} {value} {why}; try {_fix(opt)}")
    missing = [o for o in dict.fromkeys(table.values()) if o.default is dataclasses.MISSING]
    missing = [o for o in missing if o.path not in seen]
    if missing:
        names = " and ".join(flag(o.path) for o in missing)
        verb = "is" if len(missing) == 1 else "are"
        raise ConfigError(f"{names} {verb} required; try {prog} {' '.join(map(_fix, missing))}")
