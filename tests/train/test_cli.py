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


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("cli") / "run"
    assert main(["train", *SMOKE, "--guard.inject-nan-at", "3", "--out-dir", str(run)]) == 0
    return run


def test_train_writes_metrics_and_snapshot(smoke_run) -> None:
    records = read_metrics(smoke_run)
    assert records[0]["kind"] == "config" and records[0]["config"]["steps"] == 8
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6, 8]
    assert all(r["tokens_per_s"] > 0 for r in train)
    assert [r["skipped_total"] for r in train] == [0, 1, 1, 1]  # the injected NaN at step 3
    seen = [0] + [r["tokens_seen"] for r in train]
    timed = sum((b - a) / r["tokens_per_s"] for a, b, r in zip(seen, seen[1:], train))
    assert timed == pytest.approx(records[-1]["train_seconds"], rel=1e-6)  # eval time left out
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [4, 8]
    summary = records[-1]
    assert summary["kind"] == "summary" and summary["unigram_baseline"] > 0
    assert summary["skipped_steps"] == 1 and summary["skipped_nonfinite_loss"] == 1
    assert (smoke_run / "snapshots" / "LATEST").read_text() == "step_0000008"


def test_sample_from_snapshot_and_from_export_agree(smoke_run, tmp_path, capsys) -> None:
    capsys.readouterr()
    assert main(["sample", "--run", str(smoke_run), "--prompt", "import ", "--tokens", "12"]) == 0
    from_snapshot = capsys.readouterr().out
    assert from_snapshot.startswith("import ") and len(from_snapshot.encode()) > 8
    out = tmp_path / "m.safetensors"
    assert main(["export", "--run", str(smoke_run), "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["sample", "--run", str(out), "--prompt", "import ", "--tokens", "12"]) == 0
    assert capsys.readouterr().out == from_snapshot


def test_plot_and_report(smoke_run, tmp_path, capsys) -> None:
    assert main(["plot", "--run", str(smoke_run), "--out", str(tmp_path)]) == 0
    for name in ("loss.png", "lr.png", "throughput.png", "grad_norm.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    assert main(["report", "--run", str(smoke_run)]) == 0
    out = capsys.readouterr().out
    assert "skipped_steps" in out and "best_val_loss" in out


def test_tensorboard_event_files(tmp_path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "tb"
    args = [*SMOKE, "--steps", "2", "--sample-tokens", "0", "--report.tensorboard"]
    assert main(["train", *args, "--out-dir", str(run)]) == 0
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "train/loss" in tags and "eval/val_loss" in tags
    assert [e.step for e in events.Scalars("train/loss")] == [2]


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
