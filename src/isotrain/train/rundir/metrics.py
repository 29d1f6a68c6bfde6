"""`RUN/metrics.jsonl` read back: one JSON record a line, each with a `kind`.

`report.loggers` writes it; `report`, `plot` and resume read it through here, and a line a
crash cut short is counted, never fatal.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from isotrain.train.files import check_regular

__all__ = ["METRICS_FILE", "metric_lines", "read_metrics"]

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


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
    if not check_regular(path):  # a FIFO or a directory there is refused, never opened
        raise FileNotFoundError(
            f"{path}: no metrics file; try the --out-dir of an isotrain train run"
        )
    lines, bad = metric_lines(path)
    if bad:
        log.warning("%s: skipped %d unreadable line(s), cut short by a crash?", path, bad)
    return [record for _, record in lines]
