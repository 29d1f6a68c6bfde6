"""A run's state to and from snapshots: what is saved, what must match on resume, signals.

`snapshot.py` knows files; this module knows what a training run consists of.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from isotrain.contexts import capture_rng_state, restore_rng_state
from isotrain.train.config import ConfigError, TrainConfig, flag
from isotrain.train.fields import flag_value, hints, matches
from isotrain.train.files import check_regular, replace_file
from isotrain.train.rundir.integrity import SnapshotError, check_payload, one_line
from isotrain.train.rundir.metrics import METRICS_FILE, metric_lines
from isotrain.train.rundir.sharded import (
    barrier,
    check_layout,
    gather_to_main,
    load_sharded,
    rank_rng_state,
    save_sharded,
)
from isotrain.train.rundir.snapshot import find_snapshots, load_snapshot, save_snapshot
from isotrain.train.rundir.writes import writing
from isotrain.train.state import Run, TrainState

__all__ = [
    "RunComplete",
    "StopFlag",
    "StopNow",
    "changes_in_words",
    "maybe_resume",
    "other_run",
    "save_run",
    "stop_on_signals",
    "ways_on",
]

log = logging.getLogger(__name__)

# Settings that define tensor shapes: a snapshot cannot be loaded across a change of these.
SHAPE_FIELDS = ("n_layer", "n_head", "d_model", "block_size", "vocab_size", "bias")
# Settings that make a run what it is: resuming across a change would continue the old run on
# other data, another tokenizer or other random streams, so it is refused (NOTE [resume]).
IDENTITY_FIELDS = (
    *("data.path", "data.val_path", "data.val_fraction", "data.bin_dtype"),
    *("tokenizer_sha256", "seed", "init_from"),
)

# NOTE [resume]
# An automatic resume is only right when the command asks for the same run. A changed data
# path, tokenizer or seed, or a run that already finished, means the user wants something
# else: we refuse and name the three ways on rather than guess. Other changes (--steps,
# --log-every, ...) continue the run and are logged.


def ways_on(run_dir: str | Path, trained: int | None = None) -> str:
    """The ways past a refused resume, for the end of an error message; `trained` (the steps
    the run in `run_dir` has made) adds `--steps` to train it further."""
    further = f"--steps {2 * trained} to train it further, " if trained else ""
    return (
        f"try {further}a new --out-dir for a new run, or --init-from {run_dir} to start a new "
        "run from its weights"
    )


class RunComplete(Exception):
    """The run directory holds a run that already made its --steps: nothing to train."""

    def __init__(self, run_dir: str | Path, trained: int, steps: int) -> None:
        super().__init__(
            f"{run_dir} is complete: it trained {trained} of --steps {steps}; pass "
            f"--steps {2 * trained} to train it further, or a new --out-dir for a new run"
        )
        self.run_dir, self.trained = str(run_dir), trained


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
    # Only a snapshot of the step just evaluated carries a validation loss (BEST candidates).
    val = st.last_val if run.eval_step == st.step else None
    step, keep = st.step, run.cfg.snapshot.keep
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
    shape = [
        ("model." + n, saved["model"][n], getattr(cfg.model, n))
        for n in SHAPE_FIELDS
        if saved["model"][n] != getattr(cfg.model, n)
    ]
    if shape:
        raise ConfigError(
            f"cannot resume {cfg.out_dir}: its model has another shape ({changes_in_words(shape)}"
            f"); pass {'that' if len(shape) == 1 else 'those'} to continue it, or "
            f"{ways_on(cfg.out_dir).removeprefix('try ')}"
        )
    paths = IDENTITY_FIELDS + (("data.max_bytes",) if cfg.data.path is None else ())
    for path in paths:
        section, _, key = path.rpartition(".")
        old = (saved.get(section, {}) if section else saved).get(key)
        new = operator.attrgetter(path)(cfg)
        if old != new:
            raise ConfigError(
                f"{cfg.out_dir} holds a run with {flag(path)} {old!r}, not {new!r}: resuming "
                f"would continue that run on something else; {ways_on(cfg.out_dir)}"
            )
    changes = _diff(saved, dataclasses.asdict(cfg), "")
    if cfg.precision == "auto":  # auto's probe decides after the resume; the header says what
        changes = [c for c in changes if not c.startswith("--precision:")]
    return changes


# What makes the run in a directory another run than the one a command describes, when that
# command named no --out-dir (NOTE [default run directory]): its shape, its identity, how it
# is launched. `tokenizer` counts only when the command names one (auto takes the run's own).
OTHER_RUN_FIELDS = (
    *(f"model.{n}" for n in SHAPE_FIELDS),
    *(p for p in IDENTITY_FIELDS if p != "tokenizer_sha256"),
    *("tokenizer", "parallel.mode"),
)


def other_run(run_dir: str | Path, cfg: TrainConfig) -> list[tuple[str, Any, Any]]:
    """(setting, the run's value, `cfg`'s) for each way the run recorded in RUN/config.toml
    is another run than `cfg`, read without loading a snapshot; [] when it is the same run or
    none is recorded there."""
    path = Path(run_dir) / "config.toml"
    if not find_snapshots(run_dir) or not path.is_file():
        return []
    try:
        saved = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return []  # the resume's own checks read the snapshot and say what is wrong
    out = []
    for name in OTHER_RUN_FIELDS:
        section, _, key = name.rpartition(".")
        old = (saved.get(section, {}) if section else saved).get(key)
        new = operator.attrgetter(name)(cfg)
        if name == "tokenizer" and new == "auto":
            continue
        if name == "model.vocab_size" and new == type(cfg.model)().vocab_size:
            continue  # the default: the run's tokenizer decides it (NOTE [vocabulary size])
        if old != (list(new) if isinstance(new, tuple) else new):
            out.append((name, old, new))
    return out


def changes_in_words(changes: list[tuple[str, Any, Any]]) -> str:
    """`it has --model.n-layer 2 --seed 1337; this command: 4, 7` for a message."""
    was = " ".join(flag(n) + " unset" if o is None else flag_value(n, o) for n, o, _ in changes)
    return f"it has {was}; this command: {', '.join(repr(new) for _, _, new in changes)}"


def _diff(old: dict[str, Any], new: dict[str, Any], prefix: str) -> list[str]:
    out = []
    for key, value in new.items():
        if key not in old:
            continue  # a setting newer than the snapshot: nothing this command changed
        before = old[key]
        if isinstance(value, dict):
            out += _diff(before or {}, value, f"{prefix}{key}.")
        elif (list(before) if isinstance(before, (list, tuple)) else before) != (
            list(value) if isinstance(value, (list, tuple)) else value
        ):
            out.append(f"{flag(prefix + key)}: {before!r} -> {value!r}")
    return out


def _truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop records a crashed run wrote after the snapshot it resumes from, and any line a
    crash or a full disk cut short."""
    path = run_dir / METRICS_FILE
    if not check_regular(path):
        return
    lines, torn = metric_lines(path)
    keep = [ln for ln, rec in lines if _at_or_before(rec.get("step", 0), step)]
    if torn:
        log.warning("%s: dropped %d unreadable line(s), cut short by a crash", path, torn)
    if torn or len(keep) != len(lines):
        with writing(path, run_dir):
            replace_file(path, "".join(ln + "\n" for ln in keep))


def _at_or_before(value: Any, step: int) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value <= step


def _restore_state(state: TrainState, saved: dict[str, Any], path: Path) -> None:
    """Set the counters from a snapshot, after checking they are the counters of its step."""
    types = hints(TrainState)
    if set(saved) != set(types) or not all(matches(saved[k], types[k]) for k in types):
        raise SnapshotError(f"{path}: state.pt holds no valid train_state")
    if saved["step"] != int(path.name.removeprefix("step_")):
        raise SnapshotError(f"{path}: state.pt is of step {saved['step']}, not of {path.name}")
    for key, value in saved.items():
        setattr(state, key, value)


def _restore(run: Run, payload: dict[str, Any], path: Path) -> list[str]:
    """Load a verified snapshot into `run`; returns the settings that changed. A config that
    cannot continue raises ConfigError; a payload that does not fit raises SnapshotError
    (`load_snapshot` then falls back to the previous snapshot)."""
    check_payload(payload, path)
    changes = check_compatible(payload["config"], run.cfg)
    check_layout(payload, path, mode=run.cfg.parallel.mode, world_size=run.dist.world_size)
    try:
        if payload.get("sharded"):
            load_sharded(path, run.model, run.optimizer)
        else:
            run.model.load_state_dict(payload["model"])
            run.optimizer.load_state_dict(payload["optimizer"])
        run.updater.load_state_dict(payload["updater"])
        restore_rng_state(rank_rng_state(payload, run.dist.rank))
    except (ConfigError, SnapshotError):
        raise
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise SnapshotError(
            f"{path}: state.pt does not fit this run ({type(e).__name__}: {one_line(e)})"
        ) from None
    _restore_state(run.state, payload["train_state"], path)
    return changes


def maybe_resume(run: Run, *, required: bool) -> bool:
    """Continue from the run directory's newest intact snapshot, if it has one."""
    out = Path(run.cfg.out_dir)
    if not find_snapshots(out):
        if required:
            raise ConfigError(
                f"--resume {out}: no snapshot there to resume from; try --out-dir {out} to "
                "start a run there"
            )
        if run.dist.is_main and (out / METRICS_FILE).is_file():
            log.warning("%s holds metrics but no snapshot: starting over", out)
            _truncate_metrics(out, -1)
        return False
    changes: list[str] = []

    def restore(payload: dict[str, Any], path: Path) -> None:
        changes[:] = _restore(run, payload, path)

    payload, path = load_snapshot(out, check=restore)
    if run.state.step >= run.cfg.steps:
        raise RunComplete(out, run.state.step, run.cfg.steps)
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
    """Set by SIGTERM/SIGINT; the loop checks it between steps and snapshots before exiting.

    While `urgent` (the end-of-run sample, which has nothing to save), a signal stops at once.
    """

    def __init__(self) -> None:
        self.signal: int | None = None
        self.urgent = False

    def __bool__(self) -> bool:
        return self.signal is not None


class StopNow(KeyboardInterrupt):
    """A signal that stops the process at once (exit 128 + `signum`): a second SIGINT or
    SIGTERM, or one while the flag is urgent."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopFlag]:
    """Turn SIGTERM and SIGINT into a StopFlag for the block; restore the old handlers after."""
    flag_ = StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag_
        return
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def handler(signum: int, frame: object) -> None:
        urgent = bool(flag_) or flag_.urgent  # a second signal: the user insists
        flag_.signal = flag_.signal or signum
        if urgent:
            raise StopNow(signum)

    try:
        for s in old:
            signal.signal(s, handler)
        yield flag_
    finally:
        for s, h in old.items():
            signal.signal(s, h)
