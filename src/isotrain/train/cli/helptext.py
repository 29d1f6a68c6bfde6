"""`isotrain train --help`: a short page (the common flags, then one line per section), and
`--help SECTION` for one section's flags, `--help presets` for what each preset sets, and
`--help-all` for all of them.

Help strings are the config fields' attribute docstrings, the same text tyro shows.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import textwrap
import typing
from typing import Any

from isotrain.train.config import PRESETS, TrainConfig
from isotrain.train.fields import flag, flag_value, hints, leaves

__all__ = ["PAGES", "SECTIONS", "all_help", "preset_rows", "section_help", "short_help"]

# The flags a first run needs, shown on the short page (dotted field paths).
COMMON = (
    *("steps", "out_dir", "data.path", "tokenizer", "device", "precision", "resume", "init_from"),
)
RUN = "run"  # the pseudo-section of the top-level fields not in COMMON
PRESETS_PAGE = "presets"  # `--help presets`: what each preset sets
METAVARS = {
    "tokenizer": "KIND|PATH",
    "out_dir": "DIR",
    "resume": "DIR",
    "init_from": "SOURCE",
    "device": "DEVICE",
}


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its attribute docstring, read from the class source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _first_sentence(cls: type) -> str:
    doc = " ".join((inspect.getdoc(cls) or "").split())
    return doc.split(". ")[0].rstrip(".")


def _sections() -> dict[str, type]:
    return {
        f.name: hints(TrainConfig)[f.name]
        for f in dataclasses.fields(TrainConfig)
        if dataclasses.is_dataclass(hints(TrainConfig)[f.name])
    }


SECTIONS: tuple[str, ...] = (*_sections(), RUN)
PAGES: tuple[str, ...] = (*SECTIONS, "presets")


def _metavar(hint: Any, name: str) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Literal:
        return "{" + ",".join(map(str, args)) + "}"
    if typing.get_origin(hint) is tuple:
        return _metavar(args[0], name) + " ..."
    plain = [a for a in args if a is not type(None)] or [hint]
    if plain[0] is str:
        return METAVARS.get(name, "PATH" if name.endswith("path") else "TEXT")
    return {int: "N", float: "X"}.get(plain[0], "VALUE")


def _row(path: str, cls: type, cfg: Any) -> tuple[str, str]:
    """(flag and metavar, help and default) of one field."""
    name = path.rsplit(".", 1)[-1]
    hint, value = hints(cls)[name], getattr(cfg, name)
    if hint is bool:
        head, _, tail = flag(path)[2:].rpartition(".")
        left = f"{flag(path)}, --{head + '.' if head else ''}no-{tail}"
    else:
        left = f"{flag(path)} {_metavar(hint, name)}"
    shown = " ".join(map(str, value)) if isinstance(value, tuple) else value
    shown = "not set" if value is None else shown
    return left, f"{field_docs(cls).get(name, '')} ({shown})"


def _table(rows: list[tuple[str, str]], width: int = 80) -> str:
    """Two columns, the help wrapped to `width`; a long flag puts its help on the next line."""
    col = 24
    out = []
    for left, text in rows:
        wrapped = textwrap.wrap(text, width - col - 2, break_on_hyphens=False) or [""]
        if len(left) + 3 > col:
            out.append(f"  {left}")
            out += [" " * col + line for line in wrapped]
        else:
            out.append(f"  {left:<{col - 2}}{wrapped[0]}")
            out += [" " * col + line for line in wrapped[1:]]
    return "\n".join(out)


def short_help(cfg: TrainConfig) -> str:
    """The short page: usage, the common flags with their values under this preset/config,
    one line per section, and how to see the rest."""
    rows = [
        ("--preset NAME", f"tiny (default), small, smoke, speedrun; --help {PRESETS_PAGE}"),
        ("--config FILE.toml", "settings from a TOML file ([model], [optim], ... sections; "
         "a run's OUT_DIR/config.toml works as is)"),
        ("--nproc-per-node N", "N workers here through torchrun; see --help parallel"),
    ]  # fmt: skip
    for path in COMMON:
        section = path.rpartition(".")[0]
        obj = getattr(cfg, section) if section else cfg
        rows.append(_row(path, type(obj), obj))
    sections = [(s, _first_sentence(cls)) for s, cls in _sections().items()]
    sections.append((RUN, "the other top-level flags: seed, eval and log cadence, resume"))
    return "\n".join(
        [
            "usage: isotrain train [--preset NAME] [--config FILE.toml] [--FLAG VALUE ...]",
            "",
            "common flags (preset < --config FILE.toml < flags; values now in parentheses):",
            _table(rows),
            "",
            "sections: isotrain train --help SECTION lists one section's flags",
            _table(sections),
            "",
            "every flag with its help: isotrain train --help-all",
        ]
    )


def preset_rows() -> list[tuple[str, str]]:
    """(name, its docstring's first sentence and the flags it sets) for each preset."""
    base = leaves(TrainConfig())
    rows = []
    for name, make in PRESETS.items():
        sets = [flag_value(k, v) for k, v in leaves(make()).items() if v != base[k]]
        doc = " ".join((make.__doc__ or "").split()).split(". ")[0].rstrip(".")
        rows.append((name, f"{doc}" + (f"; sets {' '.join(sets)}" if sets else "")))
    return rows


def presets_help() -> str:
    """`--help presets`: each preset and the flags it sets."""
    title = "--preset NAME: a starting point; flags and --config override what it sets"
    return f"{title}\n{_table(preset_rows())}"


def all_help(cfg: TrainConfig) -> str:
    """`--help-all`: the usage, the presets, then every section's flags, wrapped alike."""
    head = short_help(cfg).split("\n", 1)[0]
    pages = [presets_help(), *(section_help(cfg, s) for s in SECTIONS)]
    return "\n\n".join([head, *pages])


def section_help(cfg: TrainConfig, section: str) -> str:
    """Every flag of one section (`run`: the top-level fields) with help and current value."""
    if section == PRESETS_PAGE:
        return presets_help()
    if section == RUN:
        names = [f.name for f in dataclasses.fields(cfg) if f.name not in _sections()]
        rows = [_row(n, TrainConfig, cfg) for n in names]
        title = "top-level flags (and the common ones)"
    else:
        obj = getattr(cfg, section)
        rows = [_row(f"{section}.{f.name}", type(obj), obj) for f in dataclasses.fields(obj)]
        title = textwrap.fill(f"--{section}.*: {_first_sentence(type(obj))}", 80)
    return f"{title}\n{_table(rows)}"
