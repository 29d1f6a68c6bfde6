"""Where a run's records go: JSON lines (always), CSV, TensorBoard, Weights & Biases.

Every record is a kind (`config`, `train`, `eval`, `skip`, `summary`, ...) and fields, most
with a `step`. Each logger takes them through one small interface, `log(kind, record)` and
`close()`; `MetricsWriter` hands every record to the loggers `--report.loggers` names.
`metrics.jsonl` is always written: `isotrain report`, `plot` and resume read it.
"""

from __future__ import annotations

import csv
import io
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from isotrain.train.fields import ConfigError, to_toml
from isotrain.train.files import check_regular, replace_file
from isotrain.train.rundir.metrics import METRICS_FILE
from isotrain.train.rundir.writes import append_line, writing

__all__ = ["Logger", "MetricsWriter", "write_config_file"]

CONFIG_FILE = "config.toml"


class Logger(Protocol):
    """One destination of the run's records (rank 0 only)."""

    def log(self, kind: str, record: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


def _clean(value: Any) -> Any:
    """JSON has no NaN/Inf: write them as strings so the file stays valid JSON lines."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _numbers(record: dict[str, Any]) -> dict[str, int | float]:
    """The numeric fields of a record but step and time (a bool as 0/1), dicts flattened one
    level (`skipped_by_reason.GRAD_SPIKE`)."""
    out: dict[str, int | float] = {}
    for key, value in record.items():
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, v in items:
            if isinstance(v, (int, float)) and key not in ("step", "time"):
                out[key if sub is None else f"{key}.{sub}"] = int(v) if isinstance(v, bool) else v
    return out


class JsonlLogger:
    """metrics.jsonl: one record per line, appended whole (a crash never leaves half of one)."""

    def __init__(self, run_dir: Path, start_step: int) -> None:
        self.path = run_dir / METRICS_FILE

    def log(self, kind: str, record: dict[str, Any]) -> None:
        line = json.dumps({k: _clean(v) for k, v in record.items()})
        with writing(self.path, self.path.parent):
            append_line(self.path, line)

    def close(self) -> None:
        """Nothing to close: the file is closed after every record."""


class CsvLogger:
    """RUN/csv/KIND.csv: a header, then one row per record of that kind (not `config`).

    A resumed run first drops the rows after its snapshot's step; a record with a new field
    rewrites its file with the wider header.
    """

    def __init__(self, run_dir: Path, start_step: int) -> None:
        self.dir, self.run_dir = _inside(run_dir, "csv"), run_dir
        self.columns: dict[str, list[str]] = {}
        with writing(self.dir, run_dir):
            self.dir.mkdir(exist_ok=True)
            for path in self.dir.glob("*.csv"):
                rows = self._rows(path)
                kept = [r for r in rows if _at_or_before(r.get("step"), start_step)]
                if len(kept) != len(rows):
                    self._rewrite(path, self._header(path), kept)

    @staticmethod
    def _header(path: Path) -> list[str]:
        if not check_regular(path):
            return []
        with path.open(newline="", encoding="utf-8") as f:
            return next(csv.reader(f), [])

    @staticmethod
    def _rows(path: Path) -> list[dict[str, str]]:
        if not check_regular(path):
            return []
        with path.open(newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f))

    @staticmethod
    def _rewrite(path: Path, columns: list[str], rows: list[dict[str, Any]]) -> None:
        buf = io.StringIO()
        writer = csv.DictWriter(buf, columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        _replace(path, buf.getvalue())

    def log(self, kind: str, record: dict[str, Any]) -> None:
        if kind == "config":  # nested settings: config.toml holds them
            return
        row: dict[str, Any] = {k: record[k] for k in ("step", "time") if k in record}
        row.update({k: v for k, v in record.items() if isinstance(v, str) and k != "kind"})
        row.update(_numbers(record))
        path = self.dir / f"{kind}.csv"
        with writing(path, self.run_dir):
            columns = self.columns.setdefault(kind, self._header(path))
            if any(k not in columns for k in row):
                rows = self._rows(path)
                columns += [k for k in row if k not in columns]
                self._rewrite(path, columns, rows)
            buf = io.StringIO()
            csv.DictWriter(buf, columns, lineterminator="").writerow(row)
            append_line(path, buf.getvalue())

    def close(self) -> None:
        """Nothing to close: each row is appended whole."""


def _at_or_before(step: str | None, start: int) -> bool:
    """A CSV row to keep on resume: no step (a summary), or a step up to the snapshot's."""
    try:
        return step is None or step == "" or float(step) <= start
    except ValueError:
        return False


class TensorBoardLogger:
    """RUN/tensorboard: every numeric field as the scalar `kind/field`; a skip as `skip/REASON`."""

    def __init__(self, run_dir: Path, start_step: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError(
                "--report.loggers tensorboard needs tensorboard: pip install "
                "'isotrain[tensorboard]'",
                name="tensorboard",
            ) from e
        # A resumed run replaces the events its crashed predecessor wrote after the snapshot.
        purge = start_step + 1 if start_step else None
        self.tb = SummaryWriter(str(_inside(run_dir, "tensorboard")), purge_step=purge)

    def log(self, kind: str, record: dict[str, Any]) -> None:
        step = record.get("step")
        if kind == "config" or not isinstance(step, int):
            return
        if kind == "skip":
            self.tb.add_scalar(f"skip/{str(record.get('reason')).lower()}", 1.0, step)
        else:
            for key, value in _numbers(record).items():
                self.tb.add_scalar(f"{kind}/{key}", float(value), step)
        self.tb.flush()

    def close(self) -> None:
        self.tb.close()


class WandbLogger:
    """A Weights & Biases run (`WANDB_MODE=offline` logs without a network; `wandb sync`
    uploads later). Files go to RUN/wandb; the config is the run's resolved config."""

    def __init__(
        self, run_dir: Path, start_step: int, config: dict[str, Any], project: str
    ) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                "--report.loggers wandb needs wandb: pip install 'isotrain[wandb]'", name="wandb"
            ) from e
        settings = wandb.Settings(silent=True, console="off", save_code=False, disable_git=True)
        _inside(run_dir, "wandb")  # where wandb.init(dir=RUN) writes
        try:
            self.run = wandb.init(
                project=project,
                dir=str(run_dir),
                name=run_dir.resolve().name,
                config=config,
                settings=settings,
            )
        except Exception as e:  # wandb raises its own kinds (no login, no network, ...)
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"--report.loggers wandb: wandb could not start ({reason}); try `wandb login`, "
                "or WANDB_MODE=offline to log without a network"
            ) from None

    def log(self, kind: str, record: dict[str, Any]) -> None:
        step = record.get("step")
        if kind == "summary":
            self.run.summary.update(_numbers(record))
        elif kind not in ("config", "skip") and isinstance(step, int):
            # W&B steps only move forward: skip records (earlier steps) are in train's counters
            self.run.log({f"{kind}/{k}": v for k, v in _numbers(record).items()}, step=step)

    def close(self) -> None:
        self.run.finish()


class MetricsWriter:
    """Hands each record to the run's loggers; metrics.jsonl always, then the chosen others.

    Disabled (ranks other than 0) it writes nothing.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool = True,
        loggers: Sequence[str] = ("jsonl",),
        start_step: int = 0,
        config: dict[str, Any] | None = None,
        wandb_project: str = "isotrain",
    ) -> None:
        self.enabled, self.loggers = enabled, list[Logger]()
        if not enabled:
            return
        with writing(run_dir, run_dir):
            run_dir.mkdir(parents=True, exist_ok=True)
        plain: dict[str, Callable[[Path, int], Logger]] = {
            "jsonl": JsonlLogger,
            "csv": CsvLogger,
            "tensorboard": TensorBoardLogger,
        }
        try:
            for name in ["jsonl", *(n for n in dict.fromkeys(loggers) if n != "jsonl")]:
                if name == "wandb":
                    logger: Logger = WandbLogger(run_dir, start_step, config or {}, wandb_project)
                else:
                    logger = plain[name](run_dir, start_step)
                self.loggers.append(logger)
        except BaseException:
            self.close()
            raise

    def write(self, kind: str, **fields: Any) -> None:
        """One record to every logger (`time` added: seconds since the epoch)."""
        if not self.enabled:
            return
        record = {"kind": kind, "time": time.time(), **fields}
        for logger in self.loggers:
            logger.log(kind, record)

    def close(self) -> None:
        """Close every logger (TensorBoard and W&B flush here)."""
        for logger in self.loggers:
            logger.close()
        self.loggers = []


def write_config_file(run_dir: Path, config: Any) -> Path:
    """RUN/config.toml: the resolved config, which `isotrain train --config` reads back."""
    path = run_dir / CONFIG_FILE
    text = "# The resolved settings of this run: isotrain train --config FILE reads them back.\n"
    with writing(path, run_dir):
        _replace(path, text + to_toml(config))
    return path


def _inside(run_dir: Path, name: str) -> Path:
    """RUN/NAME for a logger's files; a link there (pointing out of the run) is refused."""
    path = run_dir / name
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise ConfigError(f"{path} is not a directory of this run; try removing it")
    return path


def _replace(path: Path, text: str) -> None:
    """Write `path` whole through a fresh temporary file (never through a link) and rename."""
    replace_file(path, text)
