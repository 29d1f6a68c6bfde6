"""Commands that write, where writing goes wrong: a second `train` refused by a running run's
lock changes none of its files; `plot`, `export` and `prepare` on a read-only or full disk
fail in one line (exit 1, as `train` does) and leave nothing behind; `prepare` reads JSONL
records that are valid JSON but odd (lone surrogates, deep nesting) without a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import resource
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pytest
import torch

from isotrain.train.cli.main import main
from isotrain.train.data.tokenizer import HFTokenizer, text_chunks
from isotrain.train.parallel import DistInfo
from isotrain.train.rundir.lock import lock_run

SMOKE = ["--preset", "smoke", "--data.max-bytes", "60000", "--sample-tokens", "0"]
TEXT = "def f(x):\n    return x + 1  # é ✓\n\nclass A:\n    pass\n" * 30


def _hashes(root: Path) -> dict[str, str | None]:
    """Every path under `root` with the sha256 of its bytes (None for a directory)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        if p.is_file()
        else None
        for p in sorted(root.rglob("*"))
    }


def test_a_refused_second_train_leaves_the_running_run_as_it_was(tmp_path, capsys) -> None:
    """The running run is before its first snapshot (it has written its BPE tokenizer, config
    and first metrics); a second train with another tokenizer must not touch any of it."""
    run = tmp_path / "run"
    run.mkdir()
    HFTokenizer.train_bpe(text_chunks(TEXT), 300).save(run / "tokenizer.json")
    (run / "config.toml").write_text("steps = 1000\n")
    (run / "metrics.jsonl").write_text('{"kind": "config", "step": 0}\n')
    other = tmp_path / "other.json"
    HFTokenizer.train_bpe(text_chunks(TEXT[::-1]), 280).save(other)
    with lock_run(run, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))):
        before = _hashes(run)
        for tokenizer in (["bytes"], ["bpe", "--model.vocab-size", "300"], [str(other)]):
            capsys.readouterr()
            argv = ["train", *SMOKE, "--out-dir", str(run), "--tokenizer", *tokenizer]
            assert main(argv) == 2
            assert capsys.readouterr().err == (
                f"isotrain train: error: {run} is in use by another isotrain process "
                f"(PID {os.getpid()}); wait for it to finish, or try another --out-dir\n"
            )
            assert _hashes(run) == before, tokenizer


# ------------------------------------------------------- read-only folders and full disks
@contextlib.contextmanager
def _disk_full_at(nbytes: int) -> Iterator[None]:
    """Every file this process writes stops at `nbytes` (EFBIG, a real partial write in C,
    Rust and Python alike), as a nearly full disk does."""
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)


def _read_only(monkeypatch, folder: Path) -> None:
    """Writes under `folder` fail as on a read-only mount (the tests run as root, for whom
    chmod stops nothing): Python's open, os.open and mkdir, and safetensors' own writer."""
    import builtins
    import io

    import safetensors.torch as st
    from safetensors import SafetensorError

    real_open, real_mkdir, real_serialize = builtins.open, os.mkdir, st.serialize_file
    real_os_open = os.open

    def inside(path: Any) -> bool:
        p = Path(os.fsdecode(path)).absolute()
        return p == folder or folder in p.parents

    def refuse(path: Any) -> NoReturn:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))

    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, (str, os.PathLike)) and set(mode) & set("wax+") and inside(file):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)

    def os_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and inside(path):
            refuse(path)
        return real_os_open(path, flags, *args, **kwargs)

    def mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        if inside(path) and not os.path.isdir(path):
            refuse(path)
        real_mkdir(path, *args, **kwargs)

    def serialize(tensors: Any, filename: str, **kwargs: Any) -> None:
        if inside(filename):  # the library's own words for EROFS
            raise SafetensorError(
                "Error while serializing: I/O error: Read-only file system (os error 30) at "
                f'path "{Path(filename).parent}/.tmpAbC123"'
            )
        real_serialize(tensors, filename, **kwargs)

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)
    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(st, "serialize_file", serialize)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("writes") / "run"
    assert main(["train", *SMOKE, "--steps", "2", "--out-dir", str(out)]) == 0
    return out


def _corpus(folder: Path) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "a.txt").write_text(TEXT * 40)
    return folder / "a.txt"


FULL = "File too large; nothing half-written was left. Try to free some space"
RO = "Read-only file system; nothing half-written was left. Try to make it writable or choose"
# name, argv (<run>, <out>, <in> filled in), what the error names after "could not write "
WRITERS = [
    ("plot", ["plot", "<run>"], "<run>"),
    ("plot-out", ["plot", "<run>", "--out", "<out>"], "<out>"),
    ("export", ["export", "<run>"], "<run>/model.safetensors"),
    ("export-hf", ["export", "<run>", "--format", "hf"], "<run>/hf"),
    ("export-hf-out", ["export", "<run>", "--format", "hf", "--out", "<out>"], "<out>"),
    ("prepare", ["prepare", "--input", "<in>", "--out", "<out>", "--no-progress"], "<out>"),
]


@pytest.mark.parametrize("disk", ["full", "read-only"])
@pytest.mark.parametrize(("name", "argv", "names"), WRITERS, ids=[w[0] for w in WRITERS])
def test_a_full_disk_or_read_only_folder_is_one_line_and_leaves_nothing(
    run, tmp_path, monkeypatch, capsys, disk, name, argv, names
) -> None:
    paths = {"run": run, "out": tmp_path / "out", "in": _corpus(tmp_path / "in")}
    argv = [str(paths[a[1:-1]]) if a[1:-1] in paths else a for a in argv]
    named = names.replace("<run>", str(run)).replace("<out>", str(tmp_path / "out"))
    before = _hashes(run)
    capsys.readouterr()
    if disk == "read-only":
        _read_only(monkeypatch, run)
        _read_only(monkeypatch, tmp_path / "out")
        assert main(argv) == 1
        monkeypatch.undo()
    else:
        with _disk_full_at(4096):
            assert main(argv) == 1
    err = capsys.readouterr().err
    words = RO if disk == "read-only" else FULL
    if name == "prepare" and disk == "full":  # numpy's words for the same partial write
        words = " written (is the disk full?); nothing half-written was left. Try to free some"
    assert err.startswith(f"isotrain {argv[0]}: error: could not write {named}"), err
    assert err.count("\n") == 1 and "Traceback" not in err and words in err, err
    assert _hashes(run) == before  # nothing left: no image, no half file, no temporary
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_a_failed_prepare_over_prepared_data_leaves_that_data_whole(tmp_path, capsys) -> None:
    argv = ["prepare", "--input", str(_corpus(tmp_path / "in")), "--out", str(tmp_path / "out")]
    assert main([*argv, "--no-progress"]) == 0
    before = _hashes(tmp_path / "out")
    with _disk_full_at(4096):
        assert main([*argv, "--no-progress", "--overwrite"]) == 1
    assert "Try to free some space" in capsys.readouterr().err
    assert _hashes(tmp_path / "out") == before  # old token files and meta.json, no temporaries


@pytest.mark.parametrize("stage", ["_meta", "_drop_stale_meta"])
def test_prepare_fails_after_its_token_files_are_written_leaving_the_old_data_whole(
    tmp_path, monkeypatch, capsys, stage
) -> None:
    """The last things prepare does (the meta record, the old meta.json's removal) fail as a
    full disk would: the token files already written must not have replaced the old ones."""
    from isotrain.train.data import prepare as P

    out = tmp_path / "out"
    argv = ["prepare", "--input", str(_corpus(tmp_path / "in")), "--out", str(out),
            "--no-progress", "--tokenizer", "bpe", "--vocab-size", "300"]  # fmt: skip
    assert main(argv) == 0
    before = _hashes(out)
    assert {"train.bin", "val.bin", "meta.json", "tokenizer.json"} <= set(before)

    def full(*args: Any) -> NoReturn:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out / "meta.json"))

    monkeypatch.setattr(P, stage, full)
    capsys.readouterr()
    assert main([*argv, "--overwrite", "--vocab-size", "280"]) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith(f"isotrain prepare: error: could not write {out}") and err.count("\n") == 1
    )
    assert _hashes(out) == before  # old token files, tokenizer and meta.json; no temporaries


# ------------------------------------------------------------- odd but valid JSONL records
def _jsonl(tmp_path: Path, odd: str, at: int = 3) -> Path:
    lines = [json.dumps({"text": f"record {i}: " + TEXT[:200]}) for i in range(40)]
    lines[at - 1] = odd
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("tokenizer", [["bytes"], ["bpe", "--vocab-size", "300"]])
def test_a_lone_surrogate_is_replaced_and_counted_once(tmp_path, caplog, tokenizer) -> None:
    src = _jsonl(tmp_path, '{"text": "a\\ud800b \\udfff"}')
    out = tmp_path / "out"
    argv = ["prepare", "--input", str(src), "--out", str(out), "--no-progress", "--tokenizer"]
    with caplog.at_level("WARNING"):
        assert main([*argv, *tokenizer]) == 0
    said = f"{src}: 2 lone surrogate escapes (text UTF-8 cannot hold) replaced by U+FFFD"
    assert caplog.text.count(said) == 1  # once, though BPE reads the text twice
    dtype = json.loads((out / "meta.json").read_text())["dtype"]
    ids = np.fromfile(out / "train.bin", dtype=dtype)
    if tokenizer[0] == "bpe":
        text = HFTokenizer.from_file(out / "tokenizer.json").decode(ids.tolist())
    else:
        text = ids.astype(np.uint8).tobytes().decode("utf-8")
    assert "a\ufffdb \ufffd\n\n" in text  # the record, with U+FFFD where they stood


def test_a_record_nested_too_deep_is_one_line_naming_file_and_line(tmp_path, capsys) -> None:
    src = _jsonl(tmp_path, '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}", at=7)
    out = tmp_path / "out"
    assert main(["prepare", "--input", str(src), "--out", str(out), "--no-progress"]) == 2
    assert capsys.readouterr().err == (
        f"isotrain prepare: error: {src} line 7: not a JSON record (it is nested too deep to "
        "read); fix or drop that line\n"
    )
    assert not out.exists()  # made by this command, removed with its temporary files
