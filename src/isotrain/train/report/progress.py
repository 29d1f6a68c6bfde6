"""What a run shows: the header, progress on a terminal or as log lines, the end.

Writing records is `loggers`' job; reading the metrics file back is `rundir.metrics`'.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.table import Table
from rich.text import Text

from isotrain.train.environment import LAUNCHER
from isotrain.train.rundir.integrity import read_pointer
from isotrain.train.rundir.metrics import METRICS_FILE

__all__ = [
    "Progress",
    "Reporter",
    "invoked_as",
    "where_and_next",
]

log = logging.getLogger(__name__)


def _duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "-"
    s = round(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _rate(tokens_per_s: float) -> str:
    for limit, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if tokens_per_s >= limit:
            return f"{tokens_per_s / limit:.3g}{unit}"
    return f"{tokens_per_s:.0f}"


@dataclass(frozen=True)
class Progress:
    """The numbers of one log step, as a plain line or as a bar that fits the terminal."""

    step: int
    total: int
    loss: float
    lr: float
    tokens_per_s: float
    skips: int
    eta_s: float | None

    def fields(self) -> list[str]:
        """Step, loss, lr, tok/s, skips, ETA: each whole, in display order."""
        return [
            f"step {self.step}/{self.total}",
            f"loss {self.loss:.4f}",
            f"lr {self.lr:.1e}",
            f"{_rate(self.tokens_per_s)} tok/s",
            f"skips {self.skips}",
            f"eta {_duration(self.eta_s)}",
        ]

    def line(self) -> str:
        """One plain line for logs (no bar)."""
        return "  ".join(self.fields())

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        """`step 120/500 ━━━━━──── loss 2.1234 ... eta 0:04:56` in the width there is: lr, tok/s
        and skips are left out whole (never cut) to keep a bar of 10, then the bar shrinks."""
        fields, width = self.fields(), options.max_width
        for drop in ((), (2,), (2, 3), (2, 3, 4)):  # lr, then tok/s, then skips
            shown = [f for i, f in enumerate(fields) if i not in drop]
            room = width - len(" ".join(shown)) - 2
            if room >= 10:
                break
        bar = max(0, min(room, 30))
        done = round(bar * self.step / max(self.total, 1))
        text = Text(shown[0] + " ")
        text.append("━" * done, style="bar.complete").append("─" * (bar - done), style="bar.back")
        text.append(" " + " ".join(shown[1:]))
        text.no_wrap, text.overflow = True, "crop"
        yield text


class Reporter:
    """Console output of the trainer: header, progress, evaluation lines, the end.

    Progress is a live one-line bar on a terminal (`--progress`); otherwise (a pipe, a log
    file, `--no-progress`) one plain line per log step. Only rank 0 builds an enabled
    Reporter; the others stay silent.
    """

    def __init__(
        self,
        *,
        total_steps: int,
        enabled: bool,
        live: bool,
        start_step: int = 0,
        console: Console | None = None,
    ) -> None:
        self.console = console or Console(quiet=not enabled, highlight=False)
        self.enabled, self.total = enabled, total_steps
        self.live: Live | None = None
        if enabled and live and self.console.is_terminal:
            self.live = Live(console=self.console, auto_refresh=False, transient=False)
        self.start_step, self.start_time = start_step, time.perf_counter()

    def __enter__(self) -> Reporter:
        if self.live is not None:
            self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """End the live bar (it stays on screen with its last numbers)."""
        if self.live is not None:
            self.live.stop()
            self.live = None

    def header(self, facts: list[str]) -> None:
        """The run in a few lines: model, data, device, precision and why, run directory."""
        self.console.print("[bold]isotrain train[/bold]")
        for line in facts:
            self.console.print("  " + line, soft_wrap=True, markup=False)

    def progress(
        self, *, step: int, loss: float, lr: float, tokens_per_s: float, skips: int
    ) -> None:
        """The numbers of a log step: the bar on a terminal, else one plain line."""
        done = step - self.start_step
        elapsed = time.perf_counter() - self.start_time
        eta = (self.total - step) * elapsed / done if done > 0 else None
        p = Progress(step, self.total, loss, lr, tokens_per_s, skips, eta)
        if self.live is not None:
            self.live.update(p, refresh=True)
        else:
            self.console.print(p.line(), soft_wrap=True, markup=False)

    def line(self, text: str) -> None:
        """A line above the bar (evaluations, warnings worth seeing)."""
        self.console.print(text, soft_wrap=True, markup=False)

    def ending(self, summary: dict[str, str], lines: list[str]) -> None:
        """The closing table, then where things are and what to run next."""
        self.stop()
        table = Table(title="run summary", show_header=False)
        for key, value in summary.items():
            table.add_row(key, value)
        self.console.print(table)
        for line in lines:
            self.console.print(line, soft_wrap=True, markup=False)


def invoked_as() -> str:
    """How the user ran isotrain, for next-step hints: `isotrain` (on the PATH), the path they
    typed (`.venv/bin/isotrain`), or the interpreter that runs this (`.venv/bin/python -m
    isotrain`, as under torchrun), which the system python may not be. A worker of
    `isotrain train --nproc-per-node` names the launcher's program."""
    argv0 = os.environ.get(LAUNCHER) or (sys.argv[0] if sys.argv else "")
    if Path(argv0).name != "isotrain":
        exe = Path(sys.executable)
        on_path = shutil.which(exe.name)
        if on_path and Path(on_path).resolve() == exe.resolve():
            return f"{exe.name} -m isotrain"
        with contextlib.suppress(ValueError):
            return f"{exe.absolute().relative_to(Path.cwd())} -m isotrain"
        return f"{exe} -m isotrain"
    found = shutil.which("isotrain")
    if found and Path(found).resolve() == Path(argv0).resolve():
        return "isotrain"
    with contextlib.suppress(ValueError):
        return str(Path(argv0).absolute().relative_to(Path.cwd()))
    return argv0


def where_and_next(run_dir: str, loggers: tuple[str, ...] = ("jsonl",)) -> list[str]:
    """The end of a run: where snapshots, metrics and settings are, and the commands that use
    them (`make sample` in an isotrain checkout, else the isotrain command as invoked)."""
    run = Path(run_dir)
    snaps = run / "snapshots"
    latest, best = (read_pointer(snaps / name) for name in ("LATEST", "BEST"))
    marks = [f"latest {latest}"] if latest else []
    marks += [f"best {best}"] if best and best != latest else []
    lines = [
        f"snapshots  {snaps}" + (f" ({', '.join(marks)})" if marks else ""),
        f"metrics    {run / METRICS_FILE}, settings {run / 'config.toml'}",
    ]
    others = [str(run / name) for name in loggers if name != "jsonl"]  # csv/, tensorboard/, ...
    if others:
        lines.append("loggers    " + ", ".join(others))
    prog, commands = invoked_as(), ("sample", "plot", "report", "export")
    makefile = Path("Makefile")
    text = makefile.read_text(errors="replace") if makefile.is_file() else ""
    if "isotrain" in text and "\nsample:" in text:  # an isotrain checkout: make targets work
        if run == Path("runs/default"):
            lines.append("next       " + "   ".join(f"make {c}" for c in commands))
        else:
            lines.append(f"next       make sample RUN={run_dir}   (plot, report, export alike)")
        lines.append(f"           or {prog} sample {run_dir}")
    else:
        lines.append(f"next       {prog} sample {run_dir}   (plot, report, export alike)")
    return lines
