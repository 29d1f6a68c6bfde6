"""Nothing left behind after a crash: every writer names its temporaries after itself, and the
next command that writes the folder removes those of a writer that is gone, in one line.

Each writer runs in a subprocess that stops right before it would rename its temporary (the
test wraps `files._ordinary`, the last step before every rename) and is SIGKILLed there; then
the next command runs, and its files must equal those of a run that was never interrupted.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from isotrain.train import files
from isotrain.train.cli.main import main
from isotrain.train.files import remove_stale, sweep, temp_name
from isotrain.train.precision.cache import write_entry

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="start times come from /proc"
)

SMOKE = ["--preset", "smoke", "--data.max-bytes", "60000", "--sample-tokens", "0"]

# Runs `isotrain ARGV...` (or, with ARGV "cache PATH", one precision cache write), stopping
# for good at the N-th temporary of NAME, once it is written whole.
STOPPED = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import isotrain.train.files as files
    name, nth, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    ordinary, seen = files._ordinary, []

    def stop(tmp):
        if tmp.name.startswith(f".{name}.isotrain-tmp."):
            seen.append(tmp)
            if len(seen) == nth:
                print("stopped", flush=True)
                time.sleep(600)
        ordinary(tmp)

    files._ordinary = stop
    if argv[0] == "cache":
        from isotrain.train.precision.cache import write_entry
        write_entry(Path(argv[1]), "key", {"value": 1})
    else:
        from isotrain.train.cli.main import main
        main(argv)
    print("finished without stopping", flush=True)
    """
)


def _kill_while_writing(name: str, argv: list[str], *, nth: int = 1) -> None:
    """Run ARGV in a subprocess, SIGKILL it while its `nth` temporary of `name` is complete."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STOPPED, name, str(nth), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        _wait_stopped(proc)
    finally:
        proc.kill()
        proc.wait()


def _wait_stopped(proc: subprocess.Popen) -> None:
    """Read the writer's output (a header, say) until it says it stopped."""
    lines = []
    for line in proc.stdout:
        if line.strip() == "stopped":
            return
        lines.append(line)
    raise AssertionError("the writer never stopped at its temporary:\n" + "".join(lines))


def _temporaries(folder: Path) -> list[str]:
    """The temporaries under `folder` (any depth), by the final name each was for."""
    return sorted(p.name.split(".isotrain-tmp.")[0] for p in folder.rglob("*.isotrain-tmp.*"))


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.isotrain-tmp.*") if p.is_file())


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _line(count: int, size: int, folder: Path) -> str:
    """The line the next command says, for the amounts these tests write (bytes to kB)."""
    assert size < 1_000_000
    amount = f"{size} bytes" if size < 1000 else f"{size / 1000:.1f} kB"
    what = "temporary" if count == 1 else "temporaries"
    return f"removed {count} stale {what} ({amount}) left by an interrupted run in {folder}"


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("removed ")]


def _dead_writer() -> tuple[int, str]:
    """The pid and start time of a process that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=-1)
    start = files._start_of(proc.pid)
    proc.communicate(b"")
    assert start is not None and files._start_of(proc.pid) is None
    return proc.pid, start


def _name(final: str, pid: int, start: str) -> str:
    """A temporary of `final` as the writer (pid, start) would name it."""
    space = temp_name("x").split(".")[3]
    return f".{final}.isotrain-tmp.{space}.{pid}.{start}.abcd_123"


# ---------------------------------------------------------------------------------- prepare
def _prepare(out: Path, corpus: Path) -> list[str]:
    return ["prepare", "--input", str(corpus), "--out", str(out), "--no-progress"]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"line {i}: the quick brown fox\n" for i in range(600)))
    return path


def test_a_killed_prepare_is_cleared_by_the_next(tmp_path, corpus, caplog) -> None:
    data, straight = tmp_path / "data", tmp_path / "straight"
    _kill_while_writing("val.bin", _prepare(data, corpus))  # renamed first: none renamed yet
    assert _temporaries(data) == [".meta.json", ".train.bin", ".val.bin"]
    size = _size(data)
    caplog.set_level(logging.INFO)
    assert main(_prepare(data, corpus)) == 0
    assert _said(caplog) == [_line(3, size, data)]
    assert _temporaries(data) == []
    assert main(_prepare(straight, corpus)) == 0
    assert _files(data) == _files(straight)
    assert size == sum(len(b) for b in _files(straight).values())


def test_a_live_writers_temporaries_stay(tmp_path, corpus, caplog) -> None:
    data = tmp_path / "data"
    proc = subprocess.Popen(
        [sys.executable, "-c", STOPPED, "val.bin", "1", *_prepare(data, corpus)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        _wait_stopped(proc)
        caplog.set_level(logging.INFO)
        assert remove_stale(data) == (0, 0)
        assert _temporaries(data) == [".meta.json", ".train.bin", ".val.bin"]
        assert _said(caplog) == []
    finally:
        proc.kill()
        proc.wait()
    assert sweep(data)[0] == 3 and _temporaries(data) == []


# ------------------------------------------------------------------------------------ train
@pytest.mark.slow
def test_a_run_killed_in_a_snapshot_is_cleared_by_its_resume(tmp_path, caplog) -> None:
    run, straight = tmp_path / "run", tmp_path / "straight"
    args = [*SMOKE, "--steps", "4", "--snapshot.every", "2"]
    _kill_while_writing("state.pt", ["train", *args, "--out-dir", str(run)], nth=2)
    assert _temporaries(run) == [".state.pt", ".step_0000004"]  # the snapshot's directory
    assert (run / "snapshots" / "LATEST").read_text() == "step_0000002"
    size = _size(run)
    caplog.set_level(logging.INFO)
    assert main(["train", *args, "--out-dir", str(run)]) == 0
    assert _said(caplog) == [_line(1, size, run)]
    assert _temporaries(run) == []
    assert main(["train", *args, "--out-dir", str(straight)]) == 0
    resumed, done = (
        torch.load(r / "snapshots" / "step_0000004" / "state.pt", weights_only=True)
        for r in (run, straight)
    )
    assert resumed["model"].keys() == done["model"].keys()
    assert all(torch.equal(resumed["model"][k], done["model"][k]) for k in done["model"])


def test_a_run_clears_every_dead_writers_temporary_and_nothing_else(tmp_path, caplog) -> None:
    run = tmp_path / "run"
    assert main(["train", *SMOKE, "--steps", "2", "--out-dir", str(run)]) == 0
    pid, start = _dead_writer()
    snaps = run / "snapshots"
    dead = [  # what a SIGKILL leaves: a snapshot directory, a pointer, a metrics rewrite
        snaps / _name("step_0000003", pid, start),
        snaps / _name("LATEST", pid, start),
        run / _name("metrics.jsonl", pid, start),
        run / _name("config.toml", os.getpid(), "1"),  # a pid since reused (by this process)
    ]
    dead[0].mkdir()
    (dead[0] / _name("state.pt", pid, start)).write_bytes(b"s" * 1500)
    for path in dead[1:]:
        path.write_bytes(b"t" * 100)
    kept = [  # names that only look like isotrain's temporaries, or not a dead writer's
        run / ".metrics.jsonl.tmp4242",  # the style of older isotrain: no writer in it
        run / ".config.toml.tmp",
        run / _name("config.toml", pid, start).replace(".abcd_123", ".abcd_123.bak"),
        run / _name("config.toml", pid, start).replace(".isotrain-tmp.", ".isotrain-tmp.x"),
        run / _name("tokenizer.json", os.getpid(), files._start_of(os.getpid())),  # alive
    ]
    for path in kept:
        path.write_bytes(b"mine")
    caplog.set_level(logging.INFO)
    assert main(["train", *SMOKE, "--steps", "4", "--out-dir", str(run)]) == 0
    assert _said(caplog) == [_line(4, 1800, run)]
    assert [p for p in dead if os.path.lexists(p)] == []
    assert [p.read_bytes() for p in kept] == [b"mine"] * len(kept)


def test_the_line_counts_bytes_of_sparse_files_too_and_names_the_folder(
    tmp_path, caplog, monkeypatch
) -> None:
    pid, start = _dead_writer()
    for name, size in (("train.bin", 120_000_000), ("val.bin", 400_000), ("meta.json", 7)):
        with (tmp_path / _name(name, pid, start)).open("wb") as f:
            f.truncate(size)  # sparse: no disk is used
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO)
    assert remove_stale(".") == (3, 120_400_007)
    assert _said(caplog) == [
        "removed 3 stale temporaries (120.4 MB) left by an interrupted run in the current folder"
    ]
    assert list(tmp_path.iterdir()) == []


def test_links_fifos_and_other_kinds_are_never_removed(tmp_path) -> None:
    pid, start = _dead_writer()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / _name("a", pid, start)).symlink_to(victim)
    (folder / _name("b", pid, start)).symlink_to(tmp_path)
    os.mkfifo(folder / _name("c", pid, start))
    assert sweep(folder) == (0, 0)
    assert len(list(folder.iterdir())) == 3 and victim.read_bytes() == b"precious"


def test_a_planted_directory_is_removed_without_following_its_links(tmp_path) -> None:
    pid, start = _dead_writer()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_bytes(b"precious")
    planted = tmp_path / "folder" / _name("step_0000001", pid, start)
    planted.mkdir(parents=True)
    (planted / "link").symlink_to(victim)
    (planted / "file").write_bytes(b"12345")
    assert sweep(tmp_path / "folder") == (1, 5)  # the link's own bytes are not counted
    assert (victim / "keep").read_bytes() == b"precious"


# ----------------------------------------------------------------------------------- export
@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("temporaries") / "run"
    assert main(["train", *SMOKE, "--steps", "2", "--out-dir", str(run)]) == 0
    return run


EXPORTS = [("isotrain", "out.safetensors"), ("hf", "model.safetensors")]


def _weights(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """A .safetensors file's metadata and tensors (its header's key order is the library's)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


@pytest.mark.parametrize(("fmt", "name"), EXPORTS)
def test_a_killed_export_is_cleared_by_the_next(trained, tmp_path, caplog, fmt, name) -> None:
    out, straight = tmp_path / "out", tmp_path / "straight"
    out.mkdir()
    target = out / "out.safetensors" if fmt == "isotrain" else out / "hf"
    argv = ["export", str(trained), "--format", fmt, "--force"]
    _kill_while_writing(name, [*argv, "--out", str(target)])
    assert _temporaries(out) == [f".{name}"]
    size = _size(out)
    caplog.set_level(logging.INFO)
    assert main([*argv, "--out", str(target)]) == 0
    assert _said(caplog) == [_line(1, size, target if fmt == "hf" else out)]
    assert _temporaries(out) == []
    straight.mkdir()
    assert main([*argv, "--out", str(straight / target.name)]) == 0
    exported, expected = _files(out), _files(straight)
    assert exported.keys() == expected.keys()
    assert all(exported[k] == expected[k] for k in expected if not k.endswith(".safetensors"))
    (meta, weights), (meta_straight, weights_straight) = (
        _weights(next(folder.rglob("*.safetensors"))) for folder in (out, straight)
    )
    assert meta == meta_straight and weights.keys() == weights_straight.keys()
    assert all(torch.equal(weights[k], weights_straight[k]) for k in weights)


# ------------------------------------------------------------------- plots, precision cache
def test_a_killed_plot_is_cleared_by_the_next(trained, tmp_path, caplog) -> None:
    out, straight = tmp_path / "out", tmp_path / "straight"
    _kill_while_writing("lr.png", ["plot", str(trained), "--out", str(out)])
    assert _temporaries(out) == [".lr.png"]
    size = _size(out)
    caplog.set_level(logging.INFO)
    assert main(["plot", str(trained), "--out", str(out)]) == 0
    assert _said(caplog) == [_line(1, size, out / trained.name)]
    assert _temporaries(out) == []
    assert main(["plot", str(trained), "--out", str(straight)]) == 0
    assert _files(out) == _files(straight)


def test_a_killed_precision_cache_write_is_cleared_by_the_next(tmp_path, caplog) -> None:
    cache, straight = tmp_path / "cache" / "precision.json", tmp_path / "straight.json"
    _kill_while_writing("precision.json", ["cache", str(cache)])
    assert _temporaries(cache.parent) == [".precision.json"]
    size = _size(cache.parent)
    caplog.set_level(logging.INFO)
    write_entry(cache, "key", {"value": 1})
    assert _said(caplog) == [_line(1, size, cache.parent)]
    assert _temporaries(cache.parent) == []
    write_entry(straight, "key", {"value": 1})
    assert cache.read_bytes() == straight.read_bytes()
