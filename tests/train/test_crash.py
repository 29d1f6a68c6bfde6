"""Crash safety: SIGTERM snapshots and exits; SIGKILL at any moment loses only recent steps;
the resumed run ends with exactly the parameters of an uninterrupted one."""

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from isotrain.train import config as C
from isotrain.train import rules as R
from isotrain.train.cli.main import parse_train_args
from isotrain.train.loop import train
from isotrain.train.rundir.snapshot import find_snapshots, load_snapshot

ARGS = [
    "--preset",
    "smoke",
    "--data.max-bytes",
    "60000",
    "--steps",
    "60",
    "--log-every",
    "1",
    "--snapshot.every",
    "5",
    "--snapshot.keep",
    "2",
    "--model.dropout",
    "0.1",
]


def _start(out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # same thread count as the in-process run
    cmd = [sys.executable, "-m", "isotrain", "train", *ARGS, "--out-dir", str(out)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 120) -> bool:
    """True once `predicate` holds while `proc` runs; False if it finished first (exit 0)."""
    end = time.monotonic() + timeout
    while not predicate():
        code = proc.poll()
        if code is not None:
            assert code == 0, proc.stderr.read().decode()
            return False
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)
    return True


def _last_step(out: Path) -> int:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return max((json.loads(ln).get("step", 0) for ln in lines if ln.endswith("}")), default=0)


@pytest.mark.slow
def test_sigterm_then_sigkill_then_resume_matches_uninterrupted(tmp_path) -> None:
    out = tmp_path / "crashy"
    # 1. SIGTERM once training is under way: a final snapshot, then exit 128 + 15.
    proc = _start(out)
    assert _wait_for(lambda: len(find_snapshots(out)) >= 1, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143, proc.stderr.read().decode()
    assert sorted(out.rglob(".*")) == []  # no temporary file, no lock left behind
    stopped_at = int((out / "snapshots" / "LATEST").read_text().split("_")[1])
    assert 5 <= stopped_at < 60
    # 2. SIGKILL at seeded random moments of training (bounded): each restart resumes.
    rng, kills = random.Random(0), 0
    for _ in range(2):
        proc = _start(out)
        target = _last_step(out) + rng.randint(3, 12)
        if _wait_for(lambda t=target: _last_step(out) >= t, proc):  # else: it finished first
            time.sleep(rng.uniform(0.0, 0.05))  # mid-step, mid-snapshot or mid-log
            proc.kill()
            kills += 1
        proc.wait(timeout=30)
        assert not list((out / "snapshots").glob("step_*/state.pt.tmp*"))
        load_snapshot(out)  # the newest intact snapshot always loads
    assert kills >= 1
    # 3. Run to the end.
    proc = _start(out)
    assert proc.wait(timeout=180) == 0, proc.stderr.read().decode()
    assert sorted(out.rglob(".*")) == []  # what the kills left behind is gone
    # 4. The same run without interruptions, in-process.
    straight = tmp_path / "straight"
    train(dataclasses.replace(parse_train_args(ARGS), out_dir=str(straight)))
    a, _ = load_snapshot(out)
    b, _ = load_snapshot(straight)
    assert a["train_state"]["step"] == b["train_state"]["step"] == 60
    for name, tensor in b["model"].items():
        assert torch.equal(a["model"][name], tensor), name


def _flat(cfg: C.TrainConfig) -> dict[str, object]:
    """Every leaf setting by dotted path: {"model.dropout": 0.1, ...}."""
    out: dict[str, object] = {}
    for name, value in dataclasses.asdict(cfg).items():
        for key, leaf in value.items() if isinstance(value, dict) else [(None, value)]:
            out[name if key is None else f"{name}.{key}"] = leaf
    return out


def test_crash_test_flags_resolve_over_the_smoke_preset() -> None:
    # Each flag replaces its preset value, parsed to the field's type; every other setting is
    # the smoke preset's (not the tiny default's), and the result validates.
    cfg = R.validate(parse_train_args(ARGS))
    preset, got = _flat(C.PRESETS["smoke"]()), _flat(cfg)
    changed = {k: v for k, v in got.items() if v != preset[k]}
    assert changed == {
        "data.max_bytes": 60000,
        "steps": 60,
        "log_every": 1,
        "snapshot.every": 5,
        "model.dropout": 0.1,
    }
    assert type(got["data.max_bytes"]) is int and type(got["model.dropout"]) is float
    assert got["model.n_layer"] == 2 != C.TrainConfig().model.n_layer
    # A later flag wins over an earlier one, and validation names the flag, value and fix.
    message = r"^--snapshot.keep 0 is invalid: keep at least 1; try --snapshot.keep 2$"
    with pytest.raises(C.ConfigError, match=message):
        R.validate(parse_train_args([*ARGS, "--snapshot.keep", "0"]))
