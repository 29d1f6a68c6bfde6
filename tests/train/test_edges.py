"""Signals and memory at the edges of a run: SIGTERM during the end-of-run sample, a second
SIGTERM, the death of torchrun's launcher, and allocations that fail."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from isotrain.train import environment, loop
from isotrain.train.cli.main import main
from isotrain.train.rundir.metrics import read_metrics
from isotrain.train.step import train_step

SMOKE = ["--preset", "smoke", "--data.max-bytes", "60000"]


def _kinds(run: Path) -> list[str]:
    return [r["kind"] for r in read_metrics(run)]


@pytest.mark.parametrize("signals", [1, 2])
def test_sigterm_during_the_final_sample_stops_it_after_the_summary(
    tmp_path, capsys, monkeypatch, signals
) -> None:
    def endless_sample(*args, **kwargs):
        for _ in range(signals):
            signal.raise_signal(signal.SIGTERM)
        end = time.monotonic() + 30  # what a long sample would do: never return soon
        while time.monotonic() < end:
            time.sleep(0.01)
        return "never"

    monkeypatch.setattr(loop, "sample", endless_sample)
    run, start = tmp_path / "run", time.monotonic()
    assert main(["train", *SMOKE, "--steps", "2", "--out-dir", str(run)]) == 143
    assert time.monotonic() - start < 20
    err = capsys.readouterr().err
    assert "SIGTERM: the run finished at step 2 (snapshot and summary written)" in err
    assert _kinds(run)[-1] == "summary"
    assert (run / "snapshots" / "LATEST").read_text() == "step_0000002"


def test_a_second_sigterm_mid_training_exits_143(tmp_path, capsys, monkeypatch) -> None:
    def step_then_two_signals(run):
        outcome = train_step(run)
        if run.state.step == 3:
            signal.raise_signal(signal.SIGTERM)  # sets the flag
            signal.raise_signal(signal.SIGTERM)  # the user insists: stop now
        return outcome

    monkeypatch.setattr(loop, "train_step", step_then_two_signals)
    run = tmp_path / "run"
    assert main(["train", *SMOKE, "--out-dir", str(run)]) == 143
    assert "interrupted (SIGTERM)" in capsys.readouterr().err
    assert not (run / ".lock").exists()


def test_a_worker_whose_launcher_died_stops_with_a_snapshot(tmp_path, capsys, monkeypatch) -> None:
    real, calls = os.getppid(), []

    def parent() -> int:  # the launcher exits after a few steps: this process is reparented
        calls.append(1)
        return real if len(calls) <= 4 else 1

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setattr(os, "getppid", parent)
    run = tmp_path / "run"
    assert main(["train", *SMOKE, "--steps", "50", "--out-dir", str(run)]) == 143
    stopped = int((run / "snapshots" / "LATEST").read_text().removeprefix("step_"))
    assert stopped == 4  # checked after every step, never waiting for a log step
    assert "stopped at step 4 after writing its snapshot" in capsys.readouterr().err
    assert not (run / ".lock").exists()


LAUNCHER = textwrap.dedent(
    """
    import os, subprocess, sys
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "test", "PYTHONUNBUFFERED": "1"}
    worker = subprocess.Popen(
        [sys.executable, "-m", "isotrain", *sys.argv[2:]], env=env,
        stdout=subprocess.DEVNULL, stderr=open(sys.argv[1], "w"),
    )
    print(worker.pid, flush=True)
    worker.wait()
    """
)


def _gone(pid: int) -> bool:
    """The process exited (a zombie nobody reaps counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


@pytest.mark.slow
def test_killing_the_launcher_stops_the_worker(tmp_path) -> None:
    run, err = tmp_path / "run", tmp_path / "worker.err"
    argv = ["train", *SMOKE, "--steps", "100000", "--snapshot.every", "4", "--out-dir", str(run)]
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(err), *argv], stdout=subprocess.PIPE, text=True
    )
    worker = int(launcher.stdout.readline())
    try:
        end = time.monotonic() + 120
        while not (run / "snapshots" / "LATEST").is_file():
            assert time.monotonic() < end and launcher.poll() is None, err.read_text()
            time.sleep(0.05)
        launcher.kill()  # the launcher alone: its worker is left behind
        launcher.wait()
        end = time.monotonic() + 60
        while not _gone(worker):
            assert time.monotonic() < end, "the worker kept training without its launcher"
            time.sleep(0.05)
    finally:
        if not _gone(worker):
            os.kill(worker, signal.SIGKILL)
    text = err.read_text()
    assert "the launcher (PID" in text and "after writing its snapshot" in text, text
    assert not (run / ".lock").exists()
    assert "summary" not in _kinds(run)  # stopped, not finished: the same command resumes


def test_a_model_too_large_to_build_is_one_line(tmp_path, capsys, monkeypatch) -> None:
    argv = ["train", *SMOKE, "--model.vocab-size", str(10**12), "--out-dir", str(tmp_path / "r")]
    assert main(argv) == 2  # refused before it is built: its parameters alone cannot fit
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("isotrain train: error: a training step of this shape needs at least ")
    assert "available; lower --model.n-layer, --model.d-model or --model.vocab-size, or " in err
    monkeypatch.setattr(environment, "available_memory", lambda device: None)  # not readable
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("isotrain train: error: out of memory building the model: tried to ")
    assert "TiB; lower --model.n-layer, --model.d-model or --model.vocab-size" in err


@pytest.mark.parametrize(
    ("error", "size"),
    [
        (RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough "
                      "memory: you tried to allocate 123456789 bytes."), "117.7 MiB"),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
                                "total capacity of 79.1 GiB"), "2.00 GiB"),
    ],
)  # fmt: skip
def test_an_allocation_failing_in_a_step_is_one_line(
    tmp_path, capsys, monkeypatch, error, size
) -> None:
    def step_out_of_memory(run):
        if run.state.step == 2:
            raise error
        return train_step(run)

    monkeypatch.setattr(loop, "train_step", step_out_of_memory)
    assert main(["train", *SMOKE, "--out-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"isotrain train: error: out of memory in a training step: tried to allocate {size}; "
        f"lower {loop.STEP_SIZE}"
    )


def test_other_runtime_errors_are_not_called_out_of_memory(tmp_path, monkeypatch) -> None:
    def broken(run):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr(loop, "train_step", broken)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        main(["train", *SMOKE, "--out-dir", str(tmp_path / "run")])
