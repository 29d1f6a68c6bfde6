"""The `isotrain` command, in-process through main(argv), plus one subprocess smoke test."""

import csv
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import isotrain
from isotrain.train.cli.main import main, parse_train_args
from isotrain.train.rundir.metrics import read_metrics
from isotrain.train.rundir.snapshot import load_snapshot
from isotrain.train.step import train_step

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
    assert main(["sample", str(smoke_run), "--prompt", "import ", "--tokens", "12"]) == 0
    from_snapshot = capsys.readouterr().out
    assert from_snapshot.startswith("import ") and len(from_snapshot.encode()) > 8
    # --run RUN is the older spelling of the positional RUN: the same sample
    assert main(["sample", "--run", str(smoke_run), "--prompt", "import ", "--tokens", "12"]) == 0
    assert capsys.readouterr().out == from_snapshot
    out = tmp_path / "m.safetensors"
    assert main(["export", str(smoke_run), "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["sample", str(out), "--prompt", "import ", "--tokens", "12"]) == 0
    assert capsys.readouterr().out == from_snapshot


def test_plot_and_report(smoke_run, tmp_path, capsys) -> None:
    assert main(["plot", str(smoke_run), "--out", str(tmp_path)]) == 0
    for name in ("loss.png", "lr.png", "throughput.png", "grad_norm.png"):  # OUT/<run name>/
        assert (tmp_path / smoke_run.name / name).read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    assert main(["report", str(smoke_run)]) == 0
    out = capsys.readouterr().out
    assert "best_val_loss" in out
    assert re.search(r"skipped_steps\s+│ 1 ", out) and "nonfinite_loss 1" in out


def test_config_toml_resolves_to_the_same_config(smoke_run) -> None:
    saved, _ = load_snapshot(smoke_run)
    again = parse_train_args(["--config", str(smoke_run / "config.toml")])
    assert dataclasses.asdict(again) == _lists_as_tuples(saved["config"])
    # and it is not the default: the smoke settings came back from the file
    assert again != parse_train_args([]) and again.model.d_model == 32


def _lists_as_tuples(d: dict) -> dict:
    return {
        k: _lists_as_tuples(v) if isinstance(v, dict) else tuple(v) if isinstance(v, list) else v
        for k, v in d.items()
    }


def test_end_of_run_says_where_things_are_and_what_to_run(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # no Makefile here: the isotrain command itself is suggested
    run, short = tmp_path / "end", ["--steps", "2", "--sample-tokens", "0"]
    assert main(["train", *SMOKE, *short, "--out-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"snapshots  {run / 'snapshots'} (latest step_0000002)" in out
    assert f"metrics    {run / 'metrics.jsonl'}, settings {run / 'config.toml'}" in out
    prog = f"{sys.executable} -m isotrain"  # the interpreter that ran, not a bare `python`
    if shutil.which(Path(sys.executable).name) == sys.executable:
        prog = f"{Path(sys.executable).name} -m isotrain"
    assert f"next       {prog} sample {run}   (plot, report, export alike)" in out
    assert "{" not in out.split("run summary")[0]  # a short header, no JSON config line
    for fact in ("model ", "data ", "device ", "precision ", f"run dir    {run} (new run)"):
        assert fact in out
    assert re.search(r" threads?, subnormals flushed to zero", out)  # NOTE [subnormals]: default
    (tmp_path / "Makefile").write_text("# isotrain\nsample:\n\tisotrain sample $(RUN)\n")
    assert main(["train", *SMOKE, *short, "--out-dir", "runs/x"]) == 0
    assert "next       make sample RUN=runs/x   (plot, report" in capsys.readouterr().out


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_snapshots_then_exits_128_plus_its_number(
    tmp_path, capsys, monkeypatch, signum, code
) -> None:
    import isotrain.train.loop as loop

    def step_then_signal(run):
        outcome = train_step(run)
        if run.state.step == 3:
            signal.raise_signal(signum)  # the handler only sets the stop flag
        return outcome

    monkeypatch.setattr(loop, "train_step", step_then_signal)
    run, before = tmp_path / "sig", signal.getsignal(signum)
    assert main(["train", *SMOKE, "--out-dir", str(run)]) == code
    err = capsys.readouterr().err
    assert "stopped at step 3 after writing its snapshot" in err and "Traceback" not in err
    assert (run / "snapshots" / "LATEST").read_text() == "step_0000003"
    assert signal.getsignal(signum) is before  # handlers restored by train's scope


def test_loggers_csv_tensorboard_and_wandb_offline(tmp_path, monkeypatch) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run = tmp_path / "loggers"
    args = [*SMOKE, "--steps", "4", "--sample-tokens", "0", "--guard.inject-nan-at", "3"]
    assert main(["train", *args, "--report.loggers", "jsonl,csv,tensorboard,wandb",
                 "--out-dir", str(run)]) == 0  # fmt: skip
    train = [r for r in read_metrics(run) if r["kind"] == "train"]
    # CSV: the same rows as metrics.jsonl, numbers as they were
    with (run / "csv" / "train.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [r["step"] for r in train] == [2, 4]
    assert [float(r["loss"]) for r in rows] == [r["loss"] for r in train]
    with (run / "csv" / "skip.csv").open() as f:
        assert [(r["step"], r["reason"]) for r in csv.DictReader(f)] == [("3", "NONFINITE_LOSS")]
    # TensorBoard: scalars by kind, at their steps
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "train/loss" in tags and "eval/val_loss" in tags
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4]
    assert [e.step for e in events.Scalars("skip/nonfinite_loss")] == [3]
    # W&B, offline: one run in RUN/wandb whose log holds the train and eval series
    logs = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 1
    data = logs[0].read_bytes()
    assert b"train/loss" in data and b"eval/val_loss" in data


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
    assert capsys.readouterr().err == (
        "isotrain: error: unknown command 'fly'; try isotrain --help\n"
    )


def test_top_level_help_lists_every_command_and_version(capsys) -> None:
    from isotrain.train.cli.main import COMMANDS

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert re.search(rf"^  {name} +\w", out, re.M), name
    assert "--version" in out
    assert main(["--version"]) == 0
    versions = f"isotrain {isotrain.__version__} (torch {torch.__version__})"
    assert capsys.readouterr().out == versions + "\n"


@pytest.mark.parametrize(
    ("command", "has", "lacks"),
    [
        ("plot", ["RUN", "--out"], ["--format", "--which", "--prompt"]),
        ("report", ["RUN"], ["--out", "--format", "--prompt"]),
        ("export", ["RUN", "--out", "--format", "--which"], ["--prompt"]),
        ("sample", ["RUN", "--prompt", "--top-p", "--which"], ["--format", "--out"]),
    ],
)
def test_each_command_shows_only_its_own_options(capsys, command, has, lacks) -> None:
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    shown = set(re.findall(r"(?<![\w-])(--[\w-]+|RUN)(?![\w-])", out))
    assert set(has) <= shown and not set(lacks) & shown, out


def test_train_help_is_short_and_grouped(capsys) -> None:
    from isotrain.train.cli.helptext import SECTIONS
    from isotrain.train.config import TrainConfig

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    short = capsys.readouterr().out
    assert len(short.splitlines()) <= 50
    assert all(len(line) <= 80 for line in short.splitlines())
    for text in ("--preset NAME", "--config FILE.toml", "--steps N", "--help-all", "--out-dir"):
        assert text in short
    for section in SECTIONS:
        assert re.search(rf"^  {section} +\w", short, re.M), section
    # --help SECTION: every flag of that section, with the values of the chosen preset
    with pytest.raises(SystemExit):
        main(["train", "--preset", "smoke", "--help", "model"])
    model = capsys.readouterr().out
    for f in dataclasses.fields(TrainConfig().model):
        assert f"--model.{f.name.replace('_', '-')}" in model
    assert "(32)" in model  # smoke's d_model, not tiny's 128
    with pytest.raises(SystemExit):
        main(["train", "--help-all"])
    full = capsys.readouterr().out
    assert "--preset" in full and "--config" in full and "--guard.spike-k" in full


# Each line: argv, then the exit status it must give without importing torch.
NO_TORCH = """
import sys
from isotrain.train.cli.main import main
for argv, expected in [
    (["--help"], 0), (["--version"], 0), ([], 2), (["bogus"], 2),
    (["train", "--help"], 0), (["train", "--help", "guard"], 0), (["train", "--help-all"], 0),
    (["train", "--stepz", "3"], 2), (["train", "--steps", "fifty"], 2),
    (["train", "--preset", "huge"], 2), (["train", "--model.d-model", "130"], 2),
    (["sample", "--help"], 0), (["sample", "--tokenz", "3"], 2), (["doctor", "--help"], 0),
    (["export", "--help"], 0), (["plot", "--help"], 0), (["prepare", "--input"], 2),
]:
    try:
        status = main(argv)
    except SystemExit as e:
        status = e.code
    if status != expected or "torch" in sys.modules:
        raise SystemExit(f"NO: {argv} exited {status}, torch imported: {'torch' in sys.modules}")
"""


def test_help_version_and_argument_errors_answer_before_torch_is_imported() -> None:
    """They answer at once: importing torch takes seconds (1.6 s on an idle 2-core CPU)."""
    proc = subprocess.run(
        [sys.executable, "-c", NO_TORCH], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr.splitlines()[-1:]


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
    # stdout is a pipe here: one plain line per log step, no bar
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("step ") and "/4" in ln]
    assert [ln.split()[1] for ln in lines] == ["2/4", "4/4"]
    assert all(re.search(r"loss \d.* lr .* tok/s +skips \d+ +eta ", ln) for ln in lines)
    assert "━" not in proc.stdout and "\x1b[" not in proc.stdout
    lines = Path(run / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["kind"] == "summary"
    assert (run / "snapshots" / "step_0000004" / "state.pt").is_file()


def test_a_presets_settings_show_in_help_and_in_the_header(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help", "presets"])
    page = capsys.readouterr().out
    smoke = " ".join(page.split("  smoke ", 1)[1].split())
    assert "--precision fp32" in smoke and "--snapshot.every 0" in smoke and "--steps 8" in smoke
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    short = capsys.readouterr().out
    assert "--tokenizer KIND|PATH" in short and "--help presets" in short
    with pytest.raises(SystemExit):
        main(["train", "--help-all"])
    full = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 80 for line in full)
    assert not any(line.rstrip().endswith("-") for line in full)  # no word cut at a hyphen
    assert any(line.startswith("  smoke ") for line in full)
    run = tmp_path / "run"
    argv = ["train", "--preset", "smoke", "--steps", "2", "--data.max-bytes", "60000"]
    assert main([*argv, "--sample-tokens", "0", "--out-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "  precision  fp32 (--preset smoke)\n" in out  # not a flag nobody passed
    assert "  settings   --preset smoke (12), flags --data.max-bytes --steps --sample-tokens" in out
    assert "progress = true" in (run / "config.toml").read_text()  # --config keeps the bar
    assert [p.name for p in (run / "snapshots").glob("step_*")] == ["step_0000002"]
    assert main([*argv, "--precision", "fp32", "--out-dir", str(tmp_path / "b")]) == 0
    assert "  precision  fp32 (--precision fp32)\n" in capsys.readouterr().out
