"""The `isotrain` command, in-process through main(argv), plus one subprocess smoke test."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from isotrain.train.cli import main
from isotrain.train.report import read_metrics

SMOKE = ["--preset", "smoke", "--data.max-bytes", "60000"]


def test_train_writes_metrics_and_snapshot_then_sample_reads_it(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert main(["train", *SMOKE, "--out-dir", str(run)]) == 0
    records = read_metrics(run)
    assert records[0]["kind"] == "config" and records[0]["config"]["steps"] == 8
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6, 8]
    assert all(r["tokens_per_s"] > 0 and r["loss"] > 0 for r in train)
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [4, 8]
    summary = records[-1]
    assert summary["kind"] == "summary" and summary["unigram_baseline"] > 0
    assert (run / "snapshots" / "LATEST").read_text() == "step_0000008"
    capsys.readouterr()
    assert main(["sample", "--run", str(run), "--prompt", "import ", "--tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("import ") and len(out.encode()) >= len("import ") + 1


def test_bad_flag_value_prints_one_line_and_exits_2(tmp_path, capsys) -> None:
    code = main(["train", *SMOKE, "--model.n-head", "3", "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    assert "error: --model.d-model 32 is invalid: it must be divisible by --model.n-head (3)" in err
    assert "Traceback" not in err


def test_missing_data_path_is_reported(tmp_path, capsys) -> None:
    code = main(
        ["train", *SMOKE, "--data.path", str(tmp_path / "nope"), "--out-dir", str(tmp_path)]
    )
    assert code == 2
    assert "--data.path" in capsys.readouterr().err


def test_sample_without_snapshot_is_reported(tmp_path, capsys) -> None:
    assert main(["sample", "--run", str(tmp_path)]) == 2
    assert "no snapshot found" in capsys.readouterr().err


def test_unknown_command(capsys) -> None:
    assert main(["fly"]) == 2
    assert "unknown command 'fly'" in capsys.readouterr().err


@pytest.mark.slow
def test_subprocess_smoke(tmp_path) -> None:
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "isotrain", "train", *SMOKE, "--steps", "4", "--out-dir", str(run)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "run summary" in proc.stdout
    lines = Path(run / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["kind"] == "summary"
    assert (run / "snapshots" / "step_0000004" / "state.pt").is_file()
