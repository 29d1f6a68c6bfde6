"""The run directory: one writer at a time (a lock naming its holder, stale locks taken over),
write errors that say what failed and leave the run resumable, and no leftovers."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from isotrain.train.cli.main import main
from isotrain.train.files import temp_name
from isotrain.train.rundir.lock import LOCK_FILE
from isotrain.train.rundir.metrics import read_metrics
from isotrain.train.rundir.snapshot import load_snapshot

SMOKE = ["--preset", "smoke", "--data.max-bytes", "60000", "--sample-tokens", "0"]

# Another process holding a run directory the way isotrain does (flock + its PID), without
# importing torch, so it starts in milliseconds.
HOLDER = textwrap.dedent(
    """
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, f"{os.getpid()}\\n".encode())
    print("locked", flush=True)
    time.sleep(600)
    """
)


def _files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file()}


def _train(run: Path, *extra: str) -> int:
    return main(["train", *SMOKE, "--out-dir", str(run), *extra])


@pytest.fixture
def holder(tmp_path):
    """A live process holding tmp_path/run's lock; yields (run, process)."""
    run = tmp_path / "run"
    run.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run / LOCK_FILE)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "locked"
        yield run, proc
    finally:
        proc.kill()
        proc.wait()


def test_a_second_writer_is_refused_naming_the_holder(holder, capsys) -> None:
    run, proc = holder
    before = _files(run)
    assert _train(run, "--steps", "2") == 2
    err = capsys.readouterr().err
    assert err == (
        f"isotrain train: error: {run} is in use by another isotrain process (PID {proc.pid}); "
        "wait for it to finish, or try another --out-dir\n"
    )
    assert _files(run) == before  # nothing written: no metrics, no snapshot, lock untouched


def test_a_lock_left_by_a_killed_process_is_taken_over(holder, caplog) -> None:
    run, proc = holder
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (run / LOCK_FILE).read_text() == f"{proc.pid}\n"  # the file stays, the flock went
    with caplog.at_level("WARNING"):
        assert _train(run, "--steps", "2") == 0
    assert f"taking over the lock of process {proc.pid}, which no longer holds it" in caplog.text
    assert not (run / LOCK_FILE).exists()  # released (and removed) at the end of the run
    assert load_snapshot(run)[1].name == "step_0000002"


# ------------------------------------------------------------------------- full disk
ARGS = ("--steps", "5", "--snapshot.every", "2", "--log-every", "1", "--eval-every", "100")


def _enospc() -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _disk_full_at_step_4(monkeypatch, where: str) -> None:
    """Make the write of `where` at step 4 fail as a full disk does (after a partial write)."""
    import isotrain.train.report.loggers as loggers
    import isotrain.train.rundir.snapshot as snapshot

    real_save, real_atomic, real_append = torch.save, snapshot._write_atomic, loggers.append_line

    def save(obj, f, *a, **k):
        if isinstance(obj, dict) and obj.get("train_state", {}).get("step") == 4:
            f.write(b"PK\x03\x04 half a zip")
            _enospc()
        return real_save(obj, f, *a, **k)

    def atomic(path, data):
        is_4 = data == b"step_0000004" or (path.name == "meta.json" and b'"step": 4,' in data)
        if path.name == where and is_4:
            _enospc()
        return real_atomic(path, data)

    def append(path, line):
        if '"step": 4,' in line and '"kind": "train"' in line:
            with open(path, "a") as f:  # half a record reached the disk, then the crash
                f.write(line[: len(line) // 2])
            _enospc()
        return real_append(path, line)

    if where == "state.pt":
        monkeypatch.setattr(torch, "save", save)
    elif where == "metrics.jsonl":
        monkeypatch.setattr(loggers, "append_line", append)
    else:
        monkeypatch.setattr(snapshot, "_write_atomic", atomic)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("straight") / "run"
    assert _train(run, *ARGS) == 0
    return run


@pytest.mark.parametrize("where", ["metrics.jsonl", "state.pt", "meta.json", "LATEST"])
def test_a_full_disk_is_one_line_and_the_run_resumes(
    straight, tmp_path, monkeypatch, capsys, where
) -> None:
    run = tmp_path / "run"
    _disk_full_at_step_4(monkeypatch, where)
    assert _train(run, *ARGS) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "could not write" in err
    assert "No space left on device; the last good snapshot (step_0000002) is safe. " in err
    assert err.endswith("Try to free some space, then run the same command again to resume\n")
    assert [p.name for p in (run / "snapshots").iterdir() if p.name.startswith(".")] == []
    assert not (run / LOCK_FILE).exists()
    monkeypatch.undo()
    assert _train(run, *ARGS) == 0  # space freed: the same command resumes and finishes
    a, b = load_snapshot(run)[0]["model"], load_snapshot(straight)[0]["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines())
    steps = [r["step"] for r in read_metrics(run) if r["kind"] == "train"]
    assert steps == [1, 2, 3, 4, 5]


def test_a_failed_append_leaves_no_half_line(tmp_path, monkeypatch) -> None:
    import isotrain.train.rundir.writes as rundir

    path = tmp_path / "metrics.jsonl"
    rundir.append_line(path, '{"kind": "config"}')
    real_write = os.write

    def half_then_full(fd, data):
        if len(data) > 4:
            return real_write(fd, bytes(data[: len(data) // 2]))
        _enospc()

    monkeypatch.setattr(rundir.os, "write", half_then_full)
    with pytest.raises(OSError, match="No space left"):
        rundir.append_line(path, '{"kind": "train", "step": 1}')
    monkeypatch.undo()
    assert path.read_text() == '{"kind": "config"}\n'


def test_report_and_plot_tolerate_a_torn_last_line(tmp_path, capsys, caplog) -> None:
    run = tmp_path / "run"
    assert _train(run, "--steps", "2") == 0
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "train", "step": 3, "lo')
    capsys.readouterr()
    assert main(["report", "--run", str(run)]) == 0
    assert "last_train_loss" in capsys.readouterr().out
    assert main(["plot", "--run", str(run), "--out", str(tmp_path / "plots")]) == 0
    assert "skipped 1 unreadable line(s)" in caplog.text
    assert (tmp_path / "plots" / "run" / "loss.png").is_file()


# ------------------------------------------------------------------------- leftovers
def _hidden(run: Path) -> list[str]:
    """Temporaries and locks: every dot-file or dot-directory under the run."""
    return sorted(str(p.relative_to(run)) for p in run.rglob(".*"))


def test_no_temporary_survives_a_run_even_after_a_killed_one(tmp_path) -> None:
    run = tmp_path / "run"
    assert _train(run, "--steps", "2") == 0
    assert _hidden(run) == []
    writer = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], text=True,
                            capture_output=True, check=True)  # fmt: skip
    dead = temp_name("x").split(".")[3] + f".{writer.stdout.strip()}.1.abcd_123"
    snaps = run / "snapshots"  # what a SIGKILL at the worst moments leaves behind
    (snaps / f".step_0000003.isotrain-tmp.{dead}" / "shards").mkdir(parents=True)
    (snaps / f".LATEST.isotrain-tmp.{dead}").write_text("step_0000003")
    (run / f".metrics.jsonl.isotrain-tmp.{dead}").write_text("{}")
    (run / LOCK_FILE).write_text("4242\n")
    assert _train(run, "--steps", "4") == 0
    assert _hidden(run) == []
