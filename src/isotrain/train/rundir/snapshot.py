"""Save and resume complete training state, atomically, loadable without executing code.

Layout of a run directory::

    RUN/snapshots/step_0000400/state.pt   tensors and plain data (torch.load weights_only=True)
    RUN/snapshots/step_0000400/meta.json  step, val loss, format version, sha256 of every file
    RUN/snapshots/LATEST                 name of the newest complete snapshot, written last
    RUN/snapshots/BEST                   name of the best-validation snapshot

A snapshot directory is written under a temporary name, fsynced, then renamed: a crash at
any moment leaves either the old set of snapshots or the new one, never a half-written one
under a real name. Loading treats the directory as untrusted (`integrity.py`): a damaged,
altered or malformed snapshot is reported in one warning line and the previous one is used.
(Called "snapshot" so it never collides with activation checkpointing.)
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from isotrain.train.files import new_dir, new_file, replace_file
from isotrain.train.rundir.integrity import (
    SNAPSHOT_NAME,
    SnapshotError,
    check_payload,
    contained,
    manifest,
    one_line,
    read_meta,
    read_pointer,
    sha256,
    verify_files,
)
from isotrain.train.rundir.writes import writing

__all__ = [
    "FORMAT_VERSION",
    "SnapshotError",
    "find_snapshots",
    "load_snapshot",
    "open_shards",
    "publish",
    "save_snapshot",
    "snapshots_dir",
]

FORMAT_VERSION = 2  # 2: meta.json lists the sha256 of every file (1: of state.pt only)
SHARDS = "shards"  # the DCP directory inside an FSDP snapshot

log = logging.getLogger(__name__)

Check = Callable[[dict[str, Any], Path], None]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    """Write a small file through a fresh temporary and a rename (the temporary never stays;
    a link, FIFO or directory planted at `path` is refused)."""
    replace_file(path, data, sync=True)


def snapshots_dir(run_dir: str | Path) -> Path:
    """RUN/snapshots, refused when it is a link leading out of the run directory."""
    root = Path(run_dir) / "snapshots"
    if root.exists() and not contained(root, Path(run_dir)):
        raise SnapshotError(f"{root} leads out of the run directory; refusing to use it")
    return root


def save_snapshot(
    run_dir: str | Path,
    payload: dict[str, Any],
    *,
    step: int,
    val_loss: float | None = None,
    keep: int = 2,
) -> Path:
    """Write `payload` as the snapshot of `step`; update LATEST (and BEST); prune old ones."""
    root = snapshots_dir(run_dir)
    with writing(f"the snapshot of step {step}", run_dir):
        root.mkdir(parents=True, exist_ok=True)
        tmp = new_dir(root / f"step_{step:07d}")
    return publish(tmp, payload, step=step, val_loss=val_loss, keep=keep)


def _complete(tmp: Path, payload: dict[str, Any], *, step: int, val_loss: float | None) -> None:
    """Write state.pt and meta.json (with the sha256 of every file, shards included)."""
    sharded = (tmp / SHARDS).is_dir()
    with new_file(tmp / "state.pt", sync=True) as f:
        torch.save({"format_version": FORMAT_VERSION, **payload, "sharded": sharded}, f)
    files = {"state.pt": sha256(tmp / "state.pt")}
    if sharded:
        shards = sorted(p for p in (tmp / SHARDS).iterdir() if p.is_file())
        files.update({f"{SHARDS}/{p.name}": sha256(p) for p in shards})
        _fsync_dir(tmp / SHARDS)
    meta = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "val_loss": val_loss,
        "sharded": sharded,
        "world_size": payload.get("world_size", 1),
        "files": files,
    }
    _write_atomic(tmp / "meta.json", json.dumps(meta).encode())


def publish(
    tmp: Path, payload: dict[str, Any], *, step: int, val_loss: float | None, keep: int
) -> Path:
    """Complete the snapshot in `tmp` (state.pt, meta.json), rename it, move the pointers.

    `tmp` may already hold FSDP shards (`shards/`). Returns the final directory. A failed
    write raises `WriteError` and leaves no temporary behind.
    """
    root, name = tmp.parent, f"step_{step:07d}"
    final = root / name
    try:
        with writing(f"the snapshot of step {step} ({tmp})", root.parent):
            _complete(tmp, payload, step=step, val_loss=val_loss)
            if final.is_symlink() or (final.exists() and not final.is_dir()):
                final.unlink()  # planted: remove the link (or FIFO), never what it points to
            elif final.exists():  # re-saving the same step (e.g. the final snapshot)
                shutil.rmtree(final)
            os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    with writing(f"the pointers of {root}", root.parent):
        _fsync_dir(root)
        _write_atomic(root / "LATEST", name.encode())
        if _is_best(root, val_loss):
            _write_atomic(root / "BEST", name.encode())
        _prune(root, keep)
    return final


def _is_best(root: Path, val_loss: float | None) -> bool:
    """A snapshot written at an evaluation whose loss beats BEST's (a tie keeps the older)."""
    if val_loss is None or not math.isfinite(val_loss):
        return False
    best = read_pointer(root / "BEST")
    best_loss = _val_loss(root / best) if best and (root / best).is_dir() else None
    return best_loss is None or val_loss < best_loss


def _val_loss(snap: Path) -> float | None:
    """The validation loss meta.json records, if it is readable and a number."""
    try:
        value = read_meta(snap).get("val_loss")
    except SnapshotError:
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` snapshots and the best one; remove the rest, each renamed to a
    temporary first: a reader sees it whole or not at all, and a kill mid-way leaves a
    temporary the next run removes."""
    protected = {read_pointer(root / "BEST"), read_pointer(root / "LATEST")}
    for snap in find_snapshots(root.parent)[:-keep]:
        if snap.name not in protected:
            with contextlib.suppress(OSError):
                gone = new_dir(snap)
                try:
                    os.replace(snap, gone)  # onto the empty directory new_dir made
                finally:
                    shutil.rmtree(gone, ignore_errors=True)


def _step(snap: Path) -> int:
    return int(snap.name.removeprefix("step_"))


def find_snapshots(run_dir: str | Path) -> list[Path]:
    """Complete snapshot directories of a run (not links), oldest first."""
    root = snapshots_dir(run_dir)
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.glob("step_*")
        if SNAPSHOT_NAME.fullmatch(p.name) and not p.is_symlink() and (p / "meta.json").is_file()
    ]
    return sorted(found, key=_step)


def open_shards(snap: str | Path) -> tuple[Path, Any]:
    """The shard directory of FSDP snapshot `snap` and its DCP metadata, once every shard file
    matches the manifest and the metadata has been read safely (no code runs)."""
    from isotrain.train.rundir.safe_dcp import METADATA, read_metadata

    snap = Path(snap)
    files = manifest(read_meta(snap), snap)
    shards = {k: v for k, v in files.items() if k.startswith(f"{SHARDS}/") and k.count("/") == 1}
    if f"{SHARDS}/{METADATA}" not in shards:
        raise SnapshotError(f"{snap}: FSDP shard files missing from its manifest")
    verify_files(snap, shards)
    names = {k.split("/", 1)[1] for k in shards}
    return snap / SHARDS, read_metadata(snap / SHARDS, names)


def _verify(snap: Path, root: Path) -> dict[str, Any]:
    """Load one snapshot after checking every file; raise SnapshotError if it is unusable."""
    if snap.is_symlink() or not contained(snap, root):
        raise SnapshotError(f"{snap}: a link, or outside the run directory")
    meta = read_meta(snap)
    files = manifest(meta, snap)
    if meta.get("step") != _step(snap):
        raise SnapshotError(f"{snap}: meta.json names step {meta.get('step')!r}")
    verify_files(snap, files)
    if meta.get("sharded"):
        open_shards(snap)
    try:
        payload = torch.load(snap / "state.pt", map_location="cpu", weights_only=True)
    except Exception as e:  # untrusted bytes can fail in any way; weights_only runs no code
        raise SnapshotError(
            f"{snap}: state.pt holds something other than tensors and plain data, which "
            f"isotrain never loads (weights_only=True): {one_line(e)}"
        ) from None
    if not isinstance(payload, dict) or bool(payload.get("sharded")) != bool(meta.get("sharded")):
        raise SnapshotError(f"{snap}: state.pt does not hold a snapshot of the kind meta.json says")
    return payload


def load_snapshot(
    run_dir: str | Path, *, which: str = "latest", check: Check | None = check_payload
) -> tuple[dict[str, Any], Path]:
    """The newest intact snapshot (`latest`) or the best-validation one (`best`).

    A damaged snapshot, or one `check(payload, path)` refuses with a SnapshotError, is
    reported with one warning line and the previous one is used.
    """
    root = snapshots_dir(run_dir)
    damaged: dict[Path, str] = {}
    for _ in range(_RELISTS):  # each round after the pruner removed what this one was reading
        order = _order(root, run_dir, which)
        for snap in (s for s in order if s not in damaged):
            try:
                payload = _verify(snap, root)
                if check is not None:
                    check(payload, snap)
                return payload, snap
            except SnapshotError as e:
                if not os.path.lexists(snap):  # pruned while being read: list them again
                    break
                log.warning("skipping damaged snapshot: %s", e)
                damaged[snap] = str(e)
        else:
            break
    raise SnapshotError(
        f"{run_dir}: every snapshot is damaged ({len(damaged)} tried, each reported above); "
        "try another run directory, or a new --out-dir"
    )


_RELISTS = 100  # a reader racing a run that prunes every step wins long before this


def _order(root: Path, run_dir: str | Path, which: str) -> list[Path]:
    """The snapshots to try: the one the pointer names, then the others, newest first."""
    found = sorted((p for p in root.glob("step_*") if SNAPSHOT_NAME.fullmatch(p.name)), key=_step)
    if not found:
        raise SnapshotError(
            f"{run_dir}: no snapshot found (looked in {root}); try the --out-dir of a run"
        )
    pointer_file = root / ("BEST" if which == "best" else "LATEST")
    pointer = read_pointer(pointer_file)
    if pointer is not None and root / pointer not in found:
        log.warning(
            "%s names %s, which does not exist: using the newest snapshot", pointer_file, pointer
        )
    order = [root / pointer] if pointer is not None and root / pointer in found else []
    return order + [s for s in reversed(found) if s not in order]
