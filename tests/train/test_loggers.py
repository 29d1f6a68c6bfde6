"""The loggers on their own: CSV rows across a resume and a new field, links refused, and the
config file that `--config` reads back."""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import pytest

from isotrain.train.config import PRESETS, ConfigError, apply_toml
from isotrain.train.report.loggers import MetricsWriter, write_config_file
from isotrain.train.rundir.metrics import read_metrics


def _csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_csv_rows_survive_a_resume_and_a_new_field(tmp_path) -> None:
    run = tmp_path / "run"
    m = MetricsWriter(run, loggers=("csv",))
    for step in (1, 2, 3, 4):
        m.write("train", step=step, loss=1.0 / step, applied=step != 3)
    m.write("summary", steps=4)
    m.close()
    # a crash after step 4, a resume from the snapshot of step 2: rows 3 and 4 are gone
    m = MetricsWriter(run, loggers=("jsonl", "csv"), start_step=2)
    m.write("train", step=3, loss=0.3, applied=True, rolled_back_to=1)  # a new field
    m.close()
    rows = _csv(run / "csv" / "train.csv")
    assert [r["step"] for r in rows] == ["1", "2", "3"]
    assert [r["loss"] for r in rows] == ["1.0", "0.5", "0.3"]
    assert [r["applied"] for r in rows] == ["1", "1", "1"]
    assert [r["rolled_back_to"] for r in rows] == ["", "", "1"]
    assert [r["steps"] for r in _csv(run / "csv" / "summary.csv")] == ["4"]  # no step: kept
    # metrics.jsonl is written whatever the list names (resume.py truncates it, not a logger)
    assert [r["kind"] for r in read_metrics(run)] == [*["train"] * 4, "summary", "train"]
    assert not list(run.rglob(".*"))  # no temporary file left


def test_a_link_where_a_logger_writes_is_refused(tmp_path) -> None:
    run, outside = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    outside.mkdir()
    (run / "csv").symlink_to(outside)
    with pytest.raises(ConfigError, match="csv is not a directory of this run"):
        MetricsWriter(run, loggers=("csv",))
    assert not list(outside.iterdir())


def test_config_file_reads_back_to_the_same_config(tmp_path) -> None:
    odd = 'a "quoted"\\ path\twith\x7f é 😀\n'  # every escape TOML needs
    cfg = dataclasses.replace(
        PRESETS["smoke"](), out_dir=odd, resume=None, data=dataclasses.replace(
            PRESETS["smoke"]().data, buckets=(8, 16), path="x.txt"
        ),
    )  # fmt: skip
    path = write_config_file(tmp_path, cfg)
    assert apply_toml(PRESETS["tiny"](), path) == cfg
    assert apply_toml(PRESETS["small"](), path) == cfg  # whatever the preset under it
