"""Files planted where isotrain writes: for every file each command writes (train, sample,
export in both formats, plot, report, prepare), a link to a file outside, a FIFO and a
directory. Nothing outside the run changes, no command hangs (each runs under a deadline),
and each refusal is one line."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from isotrain.train.cli.main import main

SMOKE = ["--preset", "smoke", "--data.max-bytes", "60000", "--sample-tokens", "0"]
SHORT = ["--steps", "2", "--eval-every", "2", "--log-every", "1"]
BPE = ["--tokenizer", "bpe", "--model.vocab-size", "300"]
KINDS = ("link", "fifo", "dir")
DEADLINE_S = 120  # a hang is far longer; a slow machine is far shorter


class Hung(BaseException):
    """The command ran past its deadline (a blocking open on a FIFO, say)."""


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Raise Hung in the main thread after `seconds` (interrupts a blocking open)."""

    def fire(signum: int, frame: object) -> None:
        raise Hung(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _tree(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every entry under `root`: mode and, for regular files, bytes."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = os.lstat(p)
        data = p.read_bytes() if stat.S_ISREG(st.st_mode) else b""
        out[str(p.relative_to(root))] = (st.st_mode, data)
    return out


def _outside(tmp_path: Path) -> Path:
    out = tmp_path / "outside"
    (out / "folder").mkdir(parents=True)
    (out / "victim").write_bytes(b"precious")
    (out / "folder" / "config.json").write_bytes(b"another model's config")
    return out


def _plant(path: Path, kind: str, outside: Path, *, dir_target: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "link":
        path.symlink_to(outside / ("folder" if dir_target else "victim"))
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
        (path / "inside").write_bytes(b"planted")


def _run(argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    with deadline(DEADLINE_S):
        rc = main(argv)
    return rc, capsys.readouterr().err


def _check(rc: int, err: str, command: str, expect: str, outside: Path, before) -> None:
    assert _tree(outside) == before, "a file outside the run changed"
    if expect == "ok":
        assert rc == 0, err
        return
    assert rc != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"isotrain {command}: error: "), err


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """A bytes run and a BPE run of two steps, each with its snapshot, metrics and config."""
    root = tmp_path_factory.mktemp("planted")
    runs = {"bytes": root / "bytes", "bpe": root / "bpe"}
    assert main(["train", *SMOKE, *SHORT, "--out-dir", str(runs["bytes"])]) == 0
    assert main(["train", *SMOKE, *SHORT, *BPE, "--out-dir", str(runs["bpe"])]) == 0
    return runs


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


# ----------------------------------------------------------------------------- train
TRAIN = [  # (file under the new run, tokenizer, expected outcome)
    ("metrics.jsonl", "bytes", "refused"),
    ("config.toml", "bytes", "refused"),
    (".lock", "bytes", "refused"),
    ("snapshots/LATEST", "bytes", "refused"),
    ("snapshots/BEST", "bytes", "refused"),
    ("csv/train.csv", "bytes", "refused"),
    ("tokenizer.json", "bpe", "refused"),
    ("tokenizer.json", "bytes", "link removed"),  # a bytes run removes a stale tokenizer.json
]
# The names isotrain's temporaries once had (a planted one was written through): today's
# name their writer, so these are never opened, and never removed (nothing says they are ours).
OLD_TEMPORARIES = (
    ".tokenizer.json.tmp",
    ".config.toml.tmp{pid}",
    "snapshots/.LATEST.tmp{pid}",
    "snapshots/.BEST.tmp{pid}",
    "snapshots/.tmp_step_0000002_{pid}",
)


def _train(run: Path, capsys, *extra: str) -> tuple[int, str]:
    argv = ["train", *SMOKE, *SHORT, "--report.loggers", "jsonl,csv", *extra]
    return _run([*argv, "--out-dir", str(run)], capsys)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("name", "tok", "expect"), TRAIN)
def test_train(tmp_path, capsys, name, tok, expect, kind) -> None:
    outside, run = _outside(tmp_path), tmp_path / "run"
    _plant(run / name, kind, outside)
    before = _tree(outside)
    rc, err = _train(run, capsys, *(BPE if tok == "bpe" else []))
    if expect == "link removed":
        expect = "ok" if kind == "link" else "refused"
    _check(rc, err, "train", expect, outside, before)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_train_never_opens_old_temporary_names(tmp_path, capsys, kind) -> None:
    outside, run = _outside(tmp_path), tmp_path / "run"
    planted = [run / name.format(pid=os.getpid()) for name in OLD_TEMPORARIES]
    for path in planted:
        _plant(path, kind, outside)
    before = _tree(outside)
    rc, err = _train(run, capsys, *BPE)
    _check(rc, err, "train", "ok", outside, before)
    assert [p for p in planted if not os.path.lexists(p)] == []


RESUME = [  # (file under a run that resumes, expected outcome)
    ("metrics.jsonl", "refused"),
    ("config.toml", "refused"),
    (".metrics.jsonl.tmp4242", "ok"),  # what a rewrite killed midway leaves
    ("snapshots/step_0000003", "ok"),  # where the next snapshot goes
]


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("name", "expect"), RESUME)
def test_train_resuming(trained, tmp_path, capsys, name, expect, kind) -> None:
    run, outside = _copy(trained["bytes"], tmp_path), _outside(tmp_path)
    target = run / name
    if target.exists():
        target.unlink()
    _plant(target, kind, outside)
    before = _tree(outside)
    rc, err = _run(["train", *SMOKE, *SHORT, "--steps", "3", "--out-dir", str(run)], capsys)
    _check(rc, err, "train", expect, outside, before)
    if expect == "ok":
        assert (run / "snapshots" / "LATEST").read_text() == "step_0000003"


# ------------------------------------------------------- sample, export, plot, report
READERS = [  # (command, file under a finished run, the run, expected outcome, extra args)
    ("sample", "tokenizer.json", "bpe", "refused", ["--tokens", "4"]),
    ("sample", "snapshots/LATEST", "bytes", "ok", ["--tokens", "4"]),
    ("export", "model.safetensors", "bytes", "refused", []),
    ("export", "hf/model.safetensors", "bpe", "refused", ["--format", "hf"]),
    ("export", "hf/config.json", "bpe", "refused", ["--format", "hf"]),
    ("export", "hf/tokenizer.json", "bpe", "refused", ["--format", "hf"]),
    ("export", "hf/tokenizer_config.json", "bytes", "refused", ["--format", "hf"]),
    ("plot", "loss.png", "bytes", "refused", []),
    ("plot", "grad_norm.png", "bytes", "refused", []),
    ("plot", "metrics.jsonl", "bytes", "refused", []),
    ("report", "metrics.jsonl", "bytes", "refused", []),
]


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("command", "name", "which", "expect", "extra"), READERS)
def test_reader_commands(
    trained, tmp_path, capsys, command, name, which, expect, extra, kind
) -> None:
    run, outside = _copy(trained[which], tmp_path), _outside(tmp_path)
    target = run / name
    if target.exists():
        target.unlink()
    _plant(target, kind, outside)
    before = _tree(outside)
    rc, err = _run([command, str(run), *extra], capsys)
    _check(rc, err, command, expect, outside, before)


@pytest.mark.parametrize("kind", ("link", "fifo"))
def test_export_never_writes_through_a_planted_hf_folder(trained, tmp_path, capsys, kind) -> None:
    run, outside = _copy(trained["bpe"], tmp_path), _outside(tmp_path)
    _plant(run / "hf", kind, outside, dir_target=True)
    before = _tree(outside)
    rc, err = _run(["export", str(run), "--format", "hf"], capsys)
    _check(rc, err, "export", "refused", outside, before)


# ---------------------------------------------------------------------------- prepare
PREPARE = [  # (file under --out, tokenizer, expected outcome)
    ("train.bin", "bytes", "refused"),
    ("val.bin", "bytes", "refused"),
    ("meta.json", "bytes", "refused"),
    ("tokenizer.json", "bpe", "refused"),
    (".train.bin.tmp", "bytes", "ok"),
    (".val.bin.tmp", "bytes", "ok"),
    (".meta.json.tmp", "bytes", "ok"),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("name", "tok", "expect"), PREPARE)
def test_prepare(tmp_path, capsys, name, tok, expect, kind) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i}: the quick brown fox\n" for i in range(400)))
    out, outside = tmp_path / "prepared", _outside(tmp_path)
    _plant(out / name, kind, outside)
    before = _tree(outside)
    argv = ["prepare", "--input", str(text), "--out", str(out), "--tokenizer", tok]
    rc, err = _run([*argv, "--vocab-size", "300", "--overwrite", "--no-progress"], capsys)
    _check(rc, err, "prepare", expect, outside, before)
    if expect == "ok":
        assert (out / "meta.json").is_file() and os.path.lexists(out / name)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path) -> None:
    from isotrain.train.files import new_file

    target = tmp_path / "config.toml"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="disk full"), new_file(target) as f:
        f.write(b"half of the new")
        raise RuntimeError("disk full")
    assert target.read_bytes() == b"old" and list(tmp_path.iterdir()) == [target]
    with new_file(target) as f:
        f.write(b"new")
    assert target.read_bytes() == b"new" and list(tmp_path.iterdir()) == [target]
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~_umask()


def _umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old
