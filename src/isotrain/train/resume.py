"""A run's state to and from snapshots: what is saved, what must match on resume, signals.

`snapshot.py` knows files; this module knows what a training run consists of.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from isotrain.contexts import capture_rng_state, restore_rng_state
from isotrain.train.config import ConfigError, TrainConfig, flag
from isotrain.train.dist_snapshot import (
    barrier,
    check_layout,
    gather_to_main,
    load_sharded,
    rank_rng_state,
    save_sharded,
)
from isotrain.train.report import METRICS_FILE
from isotrain.train.snapshot import find_snapshots, load_snapshot, save_snapshot
from isotrain.train.state import Run

__all__ = ["StopFlag", "maybe_resume", "save_run", "stop_on_signals"]

log = logging.getLogger(__name__)

# Settings that define tensor shapes: a snapshot cannot be loaded across a change of these.
SHAPE_FIELDS = ("n_layer", "n_head", "d_model", "block_size", "vocab_size", "bias")


def save_run(run: Run) -> Path | None:
    """Snapshot everything the run needs to continue bit for bit; returns its path on rank 0.

    Call it on every rank: RNG states are gathered (each rank has its own stream), and under
    FSDP every rank writes its shards. Otherwise rank 0 writes the one copy.
    """
    st, info = run.state, run.dist
    rng = capture_rng_state()
    payload: dict[str, Any] = {
        "updater": run.updater.state_dict(),
        "train_state": dataclasses.asdict(st),
        "rng": rng,
        "config": dataclasses.asdict(run.cfg),
        "world_size": info.world_size,
    }
    if info.distributed:
        payload["rng_per_rank"] = gather_to_main(rng)  # collective: every rank gets here
    step, val, keep = st.step, st.last_val, run.cfg.snapshot.keep
    if run.cfg.parallel.mode == "fsdp":
        sharded = save_sharded(
            run.cfg.out_dir, run.model, run.optimizer, payload, step=step, val_loss=val, keep=keep
        )
        return sharded if info.is_main else None
    path: Path | None = None
    if info.is_main:
        payload.update(model=run.model.state_dict(), optimizer=run.optimizer.state_dict())
        path = save_snapshot(run.cfg.out_dir, payload, step=step, val_loss=val, keep=keep)
    if info.distributed:
        barrier()  # the snapshot is complete on return, on every rank
    return path


def check_compatible(saved: dict[str, Any], cfg: TrainConfig) -> list[str]:
    """Refuse shape changes; return the other changed settings (they are logged)."""
    for name in SHAPE_FIELDS:
        old, new = saved["model"][name], getattr(cfg.model, name)
        if old != new:
            raise ConfigError(
                f"cannot resume: {flag('model.' + name)} is {new!r} but the snapshot was "
                f"trained with {old!r}; pass {flag('model.' + name)} {old!r} or a new --out-dir"
            )
    return _diff(saved, dataclasses.asdict(cfg), "")


def _diff(old: dict[str, Any], new: dict[str, Any], prefix: str) -> list[str]:
    out = []
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, dict):
            out += _diff(before or {}, value, f"{prefix}{key}.")
        elif (list(before) if isinstance(before, (list, tuple)) else before) != (
            list(value) if isinstance(value, (list, tuple)) else value
        ):
            out.append(f"{flag(prefix + key)}: {before!r} -> {value!r}")
    return out


def _truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop records a crashed run wrote after the snapshot it resumes from."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return
    keep = [
        ln for ln in path.read_text().splitlines() if ln and json.loads(ln).get("step", 0) <= step
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(ln + "\n" for ln in keep))
    tmp.replace(path)


def maybe_resume(run: Run, *, required: bool) -> bool:
    """Continue from the run directory's newest intact snapshot, if it has one."""
    out = Path(run.cfg.out_dir)
    if not find_snapshots(out):
        if required:
            raise ConfigError(f"--resume {out}: no snapshot there to resume from")
        if run.dist.is_main and (out / METRICS_FILE).is_file():
            log.warning("%s holds metrics but no snapshot: starting over", out)
            _truncate_metrics(out, -1)
        return False
    payload, path = load_snapshot(out)
    changes = check_compatible(payload["config"], run.cfg)
    check_layout(payload, path, mode=run.cfg.parallel.mode, world_size=run.dist.world_size)
    if payload.get("sharded"):
        load_sharded(path, run.model, run.optimizer)
    else:
        run.model.load_state_dict(payload["model"])
        run.optimizer.load_state_dict(payload["optimizer"])
    run.updater.load_state_dict(payload["updater"])
    for key, value in payload["train_state"].items():
        setattr(run.state, key, value)
    restore_rng_state(rank_rng_state(payload, run.dist.rank))
    if payload.get("world_size", 1) != run.dist.world_size:
        log.warning(
            "resuming a snapshot of %s ranks with %d: batches and random streams differ from "
            "the original run from here on",
            payload.get("world_size", 1),
            run.dist.world_size,
        )
    if run.dist.is_main:
        _truncate_metrics(out, run.state.step)
    for change in changes:
        log.warning("changed on resume: %s", change)
    log.info("resumed from %s at step %d", path, run.state.step)
    return True


class StopFlag:
    """Set by SIGTERM/SIGINT; the loop checks it between steps and snapshots before exiting."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def __bool__(self) -> bool:
        return self.signal is not None


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopFlag]:
    """Turn SIGTERM and SIGINT into a StopFlag for the block; restore the old handlers after."""
    flag_ = StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag_
        return
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def handler(signum: int, frame: object) -> None:
        if flag_:  # a second signal: the user insists, stop now
            raise KeyboardInterrupt
        flag_.signal = signum

    try:
        for s in old:
            signal.signal(s, handler)
        yield flag_
    finally:
        for s, h in old.items():
            signal.signal(s, h)
