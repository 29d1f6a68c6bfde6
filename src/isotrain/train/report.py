"""What a run shows and leaves behind: the metrics file, the progress display, the summary."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from isotrain.train.rundir import append_line, writing

__all__ = ["MetricsWriter", "Reporter", "metric_lines", "read_metrics"]

METRICS_FILE = "metrics.jsonl"

log = logging.getLogger(__name__)


def _clean(value: Any) -> Any:
    """JSON has no NaN/Inf: write them as strings so the file stays valid JSON lines."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsWriter:
    """Append-only JSON-lines metrics: one `config` record, then `train`/`eval`/... records.

    With `tensorboard=True` every numeric field also goes to TensorBoard as `kind/field`.
    """

    def __init__(self, run_dir: Path, *, enabled: bool = True, tensorboard: bool = False) -> None:
        self.path = run_dir / METRICS_FILE
        self.enabled = enabled
        self.tb = None
        if enabled:
            with writing(run_dir, run_dir):
                run_dir.mkdir(parents=True, exist_ok=True)
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError(
                    "--report.tensorboard needs tensorboard: pip install 'isotrain[tensorboard]'"
                ) from e
            self.tb = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, kind: str, **fields: Any) -> None:
        """Append one record as one whole line, so a killed run keeps every record written
        and a full disk never leaves half of one (a WriteError says what happened)."""
        if not self.enabled:
            return
        record = {"kind": kind, "time": time.time(), **{k: _clean(v) for k, v in fields.items()}}
        with writing(self.path, self.path.parent):
            append_line(self.path, json.dumps(record))
        if self.tb is not None and "step" in fields:
            for key, value in fields.items():
                if (
                    isinstance(value, (int, float))
                    and not isinstance(value, bool)
                    and key != "step"
                ):
                    self.tb.add_scalar(f"{kind}/{key}", value, fields["step"])
            self.tb.flush()

    def close(self) -> None:
        """Close the TensorBoard writer, if any (the JSON file is closed after every record)."""
        if self.tb is not None:
            self.tb.close()


def metric_lines(path: Path) -> tuple[list[tuple[str, dict[str, Any]]], int]:
    """(line, record) for each readable record of a metrics file, and the number of lines
    that are not one (a write cut short by a crash or a full disk)."""
    good, bad = [], 0
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("kind"), str):
            good.append((line, record))
        else:
            bad += 1
    return good, bad


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All readable records of a run's metrics file, in order (unreadable lines: one warning)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no metrics file; try the --out-dir of an isotrain train run"
        )
    lines, bad = metric_lines(path)
    if bad:
        log.warning("%s: skipped %d unreadable line(s), cut short by a crash?", path, bad)
    return [record for _, record in lines]


class Reporter:
    """Console output of the trainer: header, live progress, evaluation lines, summary.

    Only rank 0 builds an enabled Reporter; the others get `enabled=False` and stay silent.
    """

    def __init__(self, *, total_steps: int, enabled: bool, live: bool) -> None:
        self.console = Console(quiet=not enabled, highlight=False)
        self.enabled = enabled
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not (enabled and live),
        )
        self.task = self.progress.add_task("train", total=total_steps, stats="")

    def __enter__(self) -> Reporter:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def header(self, cfg: Any, lines: list[str]) -> None:
        """Print the resolved config (as the metrics file stores it) and the run facts."""
        self.console.print("[bold]isotrain train[/bold]")
        self.console.print(json.dumps(dataclasses.asdict(cfg)), soft_wrap=True)
        for line in lines:
            self.console.print(line)

    def advance(self, step: int, stats: str) -> None:
        """Move the bar to `step` and show the latest numbers."""
        self.progress.update(self.task, completed=step, stats=stats)

    def line(self, text: str) -> None:
        """A line above the bar (evaluations, warnings worth seeing)."""
        self.console.print(text)

    def summary(self, rows: dict[str, str]) -> None:
        """The closing table."""
        table = Table(title="run summary", show_header=False)
        for key, value in rows.items():
            table.add_row(key, value)
        self.console.print(table)
