"""Commands that write, where writing goes wrong: a second `train` refused by a running run's
lock changes none of its files; `plot`, `export` and `prepare` on a read-only or full disk
fail in one line (exit 1, as `train` does) and leave nothing behind; `prepare` reads JSONL
records that are valid JSON but odd (lone surrogates, deep nesting) without a traceback.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

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
