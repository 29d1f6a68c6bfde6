"""`isotrain train | sample | plot | report | export`: argument parsing and wiring only.

Flags come from the config dataclasses through tyro; precedence is
preset < `--config FILE.toml` < flags. User errors print one clear line and exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import tyro

from isotrain.train.config import PRESETS, ConfigError, TrainConfig, apply_toml, validate
from isotrain.train.data import DataError
from isotrain.train.rundir import WriteError
from isotrain.train.snapshot import SnapshotError

__all__ = ["main"]

USER_ERRORS = (ConfigError, DataError, SnapshotError, FileNotFoundError)
# Optional packages and the extra that installs each: a missing one is a user error too.
EXTRAS = {"matplotlib": "plots", "tensorboard": "tensorboard", "safetensors": "export"}
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
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            args = tyro.cli(cls, args=list(argv), prog=prog, **kwargs)
    except SystemExit as e:
        if e.code:
            reason = _one_line(captured.getvalue()).rstrip(".")
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


def parse_train_args(argv: Sequence[str]) -> TrainConfig:
    """Resolve preset, TOML file and flags into one TrainConfig."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(list(argv))
    cfg = PRESETS[known.preset]()
    if known.config:
        cfg = apply_toml(cfg, known.config)
    desc = (
        "Train the GPT. Presets: " + ", ".join(sorted(PRESETS)) + " (--preset NAME, default "
        "tiny); --config FILE.toml overlays a TOML file; flags override both."
    )
    return parse(TrainConfig, rest, "isotrain train", default=cfg, description=desc)


def cmd_train(argv: Sequence[str]) -> int:
    from isotrain.train.loop import train

    cfg = parse_train_args(argv)
    train(validate(cfg))
    return 0


@dataclass(frozen=True, kw_only=True)
class SampleArgs:
    """Generate text from a trained run."""

    run: str
    """Run directory holding snapshots, or a .safetensors file from `isotrain export`."""
    prompt: str = "def "
    """Text to continue."""
    tokens: int = 200
    """Number of bytes to generate."""
    temperature: float = 0.8
    """Sampling temperature; 0 picks the most likely byte."""
    top_k: int | None = 50
    """Sample among the k most likely bytes (None: all)."""
    seed: int = 0
    """Seed of the sampling generator (the global RNG is never touched)."""
    which: Literal["latest", "best"] = "latest"
    """Snapshot to load: the newest or the best-validation one."""


def cmd_sample(argv: Sequence[str]) -> int:
    from isotrain.train.sampling import sample

    args = parse(SampleArgs, argv, "isotrain sample")
    model = _load(args.run, args.which)
    text = sample(
        model,
        args.prompt,
        args.tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
    )
    sys.stdout.write(args.prompt + text + "\n")
    return 0


def _load(source: str, which: str) -> Any:
    """The model to sample from; an unreadable export file is a user error, not a traceback."""
    from safetensors import SafetensorError

    from isotrain.train.weights import load_model

    if not source.endswith(".safetensors"):
        return load_model(source, which=which)
    try:
        return load_model(source, which=which)
    except (SafetensorError, ValueError, TypeError, KeyError, RuntimeError, OSError) as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"--run {source}: not a readable isotrain export ({reason}); "
            "try a file written by isotrain export"
        ) from None


@dataclass(frozen=True, kw_only=True)
class RunArgs:
    """A run directory to read."""

    run: str
    """Run directory (from `isotrain train --out-dir`)."""
    out: str | None = None
    """Output: a directory for plot (default: the run), a .safetensors file for export."""
    which: Literal["latest", "best"] = "latest"
    """Snapshot to read (export): the newest or the best-validation one."""


def cmd_plot(argv: Sequence[str]) -> int:
    from isotrain.train.plots import plot_run

    args = parse(RunArgs, argv, "isotrain plot")
    check_output("--out", Path(args.out or args.run), is_dir=True)
    for path in plot_run(args.run, args.out):
        sys.stdout.write(f"wrote {path}\n")
    return 0


def cmd_report(argv: Sequence[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    from isotrain.train.plots import summarize_run

    args = parse(RunArgs, argv, "isotrain report")
    table = Table(title=f"isotrain report: {args.run}", show_header=False)
    for key, value in summarize_run(args.run).items():
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    Console(highlight=False).print(table)
    return 0


def cmd_export(argv: Sequence[str]) -> int:
    from isotrain.train.export import export_run

    args = parse(RunArgs, argv, "isotrain export")
    target = Path(args.out or f"{args.run}/model.safetensors")
    check_output("--out", target, is_dir=False)
    out, snap = export_run(args.run, target, which=args.which)
    sys.stdout.write(f"wrote {out} (weights of {snap.name})\n")
    return 0


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "train": cmd_train,
    "sample": cmd_sample,
    "plot": cmd_plot,
    "report": cmd_report,
    "export": cmd_export,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `isotrain` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: isotrain {" + ",".join(COMMANDS) + "} [--help] [options]"
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(usage + "\n")
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        sys.stderr.write(f"isotrain: unknown command {argv[0]!r}\n{usage}\n")
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[argv[0]](argv[1:])
    except USER_ERRORS as e:
        sys.stderr.write(f"isotrain {argv[0]}: error: {e}\n")
        return 2
    except WriteError as e:  # the machine, not the command: exit 1
        sys.stderr.write(f"isotrain {argv[0]}: error: {e}\n")
        return 1
    except ImportError as e:
        extra = EXTRAS.get((e.name or getattr(e.__cause__, "name", None) or "").split(".")[0])
        if extra is None:
            raise
        fix = "" if "pip install" in str(e) else f"; try pip install 'isotrain[{extra}]'"
        sys.stderr.write(f"isotrain {argv[0]}: error: {e}{fix}\n")
        return 2
