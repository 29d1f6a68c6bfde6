"""Argument parsing shared by the `isotrain` commands: tyro with one-line errors, the run
directory argument (RUN or --run RUN), and output paths checked before anything is written.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

import tyro

from isotrain.train.cli.flags import check_argv
from isotrain.train.config import ConfigError

__all__ = ["RunArgs", "check_output", "parse", "run_of"]

T = TypeVar("T")


def _one_line(box: str) -> str:
    """tyro's error message as one line: the title (first line), frames, rules and help
    pointers dropped. Handles the framed (terminal) and the plain (captured) layout."""
    lines = [
        ln.strip().strip("│┃|").strip() for ln in re.sub(r"\x1b\[[0-9;]*m", "", box).splitlines()
    ]
    lines = [ln for ln in lines if ln and not set(ln) <= set("─━-=+╭╮╰╯ ")][1:]
    words = []
    for line in lines:
        if line.startswith(("For full helptext", "Argument helptext")):
            break
        words.append(line)
    return " ".join(words) or "invalid arguments"


def parse(cls: type[T], argv: Sequence[str], prog: str, **kwargs: Any) -> T:
    """`tyro.cli`, with a parse error turned into a one-line ConfigError (`--help` unchanged)."""
    if not any(a in ("-h", "--help") for a in argv):
        check_argv(cls, list(argv), prog, default=kwargs.get("default"))
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            args = tyro.cli(cls, args=list(argv), prog=prog, **kwargs)
    except SystemExit as e:
        if e.code:
            reason = _one_line(captured.getvalue()).rstrip(".")
            if reason.startswith("Missing from"):  # tyro lists each with its whole help
                missing = dict.fromkeys(re.findall(r"(?<!\w)--[\w.-]+", reason))
                reason = f"{', '.join(missing) or 'an argument'} is required"
            raise ConfigError(f"{reason}; try {prog} --help") from None
        sys.stderr.write(captured.getvalue())
        raise
    sys.stderr.write(captured.getvalue())  # warnings of a successful parse
    return args


def check_output(option: str, path: Path, *, is_dir: bool) -> None:
    """Refuse an output path that cannot be written: a directory where a file goes (or the
    reverse), or a path under a file."""
    for at in (path, *path.parents):
        if at.exists():
            if at == path and at.is_dir() != is_dir:
                kind = "a directory" if at.is_dir() else "a file"
                raise ConfigError(f"{option} {path} is {kind}; try another {option}")
            if at != path and not at.is_dir():
                raise ConfigError(f"{option} {path} lies under the file {at}; try another {option}")
            return


RunDir = Annotated[str | None, tyro.conf.Positional, tyro.conf.arg(metavar="RUN")]


@dataclass(frozen=True, kw_only=True)
class RunArgs:
    """A run to read: RUN, or --run RUN."""

    run_dir: RunDir = None
    """Run directory (the --out-dir of isotrain train)."""
    run: str | None = None
    """The same as RUN (the older form)."""


def run_of(args: RunArgs, prog: str) -> str:
    """The run a command reads: RUN or --run RUN (exactly one of them)."""
    if args.run_dir is not None and args.run is not None and args.run_dir != args.run:
        raise ConfigError(f"two runs given ({args.run_dir}, --run {args.run}); try just RUN")
    run = args.run_dir if args.run_dir is not None else args.run
    if run is None:
        raise ConfigError(f"which run? try {prog} runs/default")
    return run
