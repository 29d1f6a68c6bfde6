"""`isotrain train --nproc-per-node N`: torchrun's launcher in-process, a command checked
before any worker starts, and a failed job told in one line without torchrun's traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from isotrain.train.cli import launch as L
from isotrain.train.cli.main import main
from isotrain.train.environment import LAUNCHER
from isotrain.train.report import progress

SMOKE = ["--preset", "smoke", "--data.max-bytes", "60000", "--sample-tokens", "0"]


@pytest.fixture
def no_launch(monkeypatch, tmp_path):
    """Fail the test if a worker would start; run in an empty directory."""
    monkeypatch.chdir(tmp_path)
    for v in ("RANK", "TORCHELASTIC_ERROR_FILE", LAUNCHER):
        monkeypatch.delenv(v, raising=False)

    def refuse(*a: object) -> int:
        raise AssertionError("a worker was started")

    monkeypatch.setattr(L, "launch", refuse)
    monkeypatch.setattr("isotrain.train.cli.main.launch", refuse)
    return tmp_path


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--nproc-per-node", "two"], "--nproc-per-node two is not a positive integer; try "
         "--nproc-per-node 2"),
        (["--nproc-per-node=0"], "--nproc-per-node 0 is not a positive integer; try "
         "--nproc-per-node 2"),
        (["--nproc-per-node"], "--nproc-per-node is not a positive integer; try "
         "--nproc-per-node 2"),
        (["--nproc-per-node", "2"], "--nproc-per-node 2 trains one model in 2 processes: pass "
         "--parallel.mode ddp (or fsdp)"),
        (["--nproc-per-node", "2", "--parallel.mode", "ddp", "--model.n-layer", "0"],
         "--model.n-layer 0 is invalid: it must be a positive integer; try --model.n-layer 4"),
    ],
)  # fmt: skip
def test_a_bad_command_is_one_line_before_any_worker_starts(no_launch, capsys, argv, error):
    assert main(["train", *SMOKE, *argv]) == 2
    assert capsys.readouterr().err == f"isotrain train: error: {error}\n"
    assert list(no_launch.iterdir()) == []


def test_a_command_that_meets_another_run_in_runs_default_is_refused_before_spawning(
    no_launch, capsys
) -> None:
    assert main(["train", *SMOKE, "--steps", "2"]) == 0  # runs/default: a one-process run
    before = sorted(p.name for p in (no_launch / "runs").iterdir())
    capsys.readouterr()
    argv = ["train", *SMOKE, "--steps", "2", "--nproc-per-node", "2", "--parallel.mode", "ddp"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("isotrain train: error: runs/default holds another run (") and (
        "pass --out-dir runs/smoke-ddp (or any new directory)" in err
    ), err
    assert sorted(p.name for p in (no_launch / "runs").iterdir()) == before


def test_the_flag_is_taken_out_of_the_workers_command_and_refused_inside_torchrun(
    monkeypatch,
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert L.nproc_per_node(["--steps", "3", "--nproc-per-node=4", "--seed", "1"]) == (
        4,
        ["--steps", "3", "--seed", "1"],
    )
    assert L.nproc_per_node(["--steps", "3"]) == (None, ["--steps", "3"])
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(L.ConfigError, match="^--nproc-per-node starts torchrun itself; under"):
        L.nproc_per_node(["--nproc-per-node", "2"])


def _failure(tmp_path: Path, rank: int, exitcode: int, message: str | None) -> ProcessFailure:
    error_file = str(tmp_path / f"error{rank}.json")
    if message is not None:
        os.environ["TORCHELASTIC_ERROR_FILE"] = error_file
        assert L.tell_launcher(message) is False  # plain torchrun: the worker prints it too
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=error_file)


def test_a_workers_line_reaches_the_launcher_through_torchruns_error_file(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.delenv(LAUNCHER, raising=False)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", "")
    line = "isotrain train: error: --data.path x: no such file or directory"
    failed = ChildFailedError("isotrain", {1: _failure(tmp_path, 1, 2, line)})
    assert L.failed_worker(failed) == (line, 2)
    assert line in str(failed)  # plain torchrun's own summary shows it as the root cause
    crashed = ChildFailedError("isotrain", {0: _failure(tmp_path, 0, 1, None)})
    assert L.failed_worker(crashed) == (
        "isotrain train: error: worker rank 0 failed with exit code 1; its output is above",
        1,
    )
    killed = ChildFailedError("isotrain", {3: _failure(tmp_path, 3, -9, None)})
    assert L.failed_worker(killed) == (
        "isotrain train: error: worker rank 3 was stopped by SIGKILL",
        1,
    )


def test_a_launched_worker_leaves_its_error_to_the_launcher(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    for rank, launched in (("0", ""), ("0", "/venv/bin/isotrain"), ("1", "/venv/bin/isotrain")):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv(LAUNCHER, launched)
        assert main(["train", "--steps", "x"]) == 2
        said = capsys.readouterr().err
        line = "isotrain train: error: --steps x is not an integer; try --steps 1000"
        assert said == ("" if launched else line + "\n")
        assert json.loads(error_file.read_text())["message"] == line
        error_file.unlink()
    monkeypatch.setenv(LAUNCHER, str(tmp_path / ".venv" / "bin" / "isotrain"))
    assert progress.invoked_as() == ".venv/bin/isotrain"  # the hint names what the user ran


@pytest.mark.slow
def test_two_workers_train_and_a_failed_job_is_one_line_without_torchruns_traceback(tmp_path):
    isotrain = [sys.executable, "-m", "isotrain", "train", "--nproc-per-node", "2"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "OMP_NUM_THREADS")}
    run = lambda *argv: subprocess.run(  # noqa: E731
        [*isotrain, "--parallel.mode", "ddp", *SMOKE, *argv],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    failed = run("--data.path", "missing/")
    assert failed.returncode == 2, failed.stderr
    assert failed.stderr.splitlines() == [
        "isotrain train: starting 2 workers through torchrun on this machine, "
        f"{max(1, len(os.sched_getaffinity(0)) // 2)} thread"
        f"{'s' if len(os.sched_getaffinity(0)) >= 4 else ''} each (OMP_NUM_THREADS)",
        "isotrain train: error: --data.path missing/: no such file or directory",
    ]
    assert failed.stdout == ""
    done = run("--steps", "2", "--out-dir", "runs/ddp")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "torch.distributed" not in done.stderr
    records = [json.loads(ln) for ln in (tmp_path / "runs/ddp/metrics.jsonl").open()]
    assert [r["step"] for r in records if r["kind"] == "train"][-1] == 2
    assert "2 ranks (ddp)" in done.stdout
    assert "-m isotrain sample runs/ddp   (plot" in done.stdout  # the program the user ran
