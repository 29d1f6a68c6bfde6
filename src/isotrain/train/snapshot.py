"""Save and resume complete training state, atomically, loadable without executing code.

Layout of a run directory::

    RUN/snapshots/step_000400/state.pt   tensors and plain data (torch.load weights_only=True)
    RUN/snapshots/step_000400/meta.json  step, val loss, sha256 of state.pt, format version
    RUN/snapshots/LATEST                 name of the newest complete snapshot, written last
    RUN/snapshots/BEST                   name of the best-validation snapshot

A snapshot directory is written under a temporary name, fsynced, then renamed: a crash at
any moment leaves either the old set of snapshots or the new one, never a half-written one
under a real name. (Called "snapshot" so it never collides with activation checkpointing.)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "FORMAT_VERSION",
    "SnapshotError",
    "find_snapshots",
    "load_snapshot",
    "publish",
    "save_snapshot",
    "temp_dir",
]

FORMAT_VERSION = 1
SHARDS = "shards"  # the DCP directory inside an FSDP snapshot

log = logging.getLogger(__name__)


class SnapshotError(RuntimeError):
    """No usable snapshot: the message says which were tried and why they failed."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    """Write a small file through a temporary name and a rename."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_snapshot(
    run_dir: str | Path,
    payload: dict[str, Any],
    *,
    step: int,
    val_loss: float | None = None,
    keep: int = 2,
) -> Path:
    """Write `payload` as the snapshot of `step`; update LATEST (and BEST); prune old ones."""
    root = Path(run_dir) / "snapshots"
    root.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(root, step, os.getpid())
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return publish(tmp, payload, step=step, val_loss=val_loss, keep=keep)


def temp_dir(root: Path, step: int, token: int) -> Path:
    """Where the snapshot of `step` is written before `publish` renames it into place."""
    return root / f".tmp_step_{step:07d}_{token}"


def publish(
    tmp: Path, payload: dict[str, Any], *, step: int, val_loss: float | None, keep: int
) -> Path:
    """Complete the snapshot in `tmp` (state.pt, meta.json), rename it, move the pointers.

    `tmp` may already hold FSDP shards (`shards/`): they are listed in meta.json with sizes.
    Returns the final directory.
    """
    root, name = tmp.parent, f"step_{step:07d}"
    final = root / name
    sharded = (tmp / SHARDS).is_dir()
    with (tmp / "state.pt").open("wb") as f:
        torch.save({"format_version": FORMAT_VERSION, **payload, "sharded": sharded}, f)
        f.flush()
        os.fsync(f.fileno())
    meta: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "val_loss": val_loss,
        "sha256": _sha256(tmp / "state.pt"),
    }
    if sharded:
        shards = tmp / SHARDS
        files = {p.name: p.stat().st_size for p in sorted(shards.iterdir()) if p.is_file()}
        meta.update(sharded=True, world_size=payload.get("world_size"), shard_files=files)
        _fsync_dir(shards)
    _write_atomic(tmp / "meta.json", json.dumps(meta).encode())
    if final.exists():  # re-saving the same step (e.g. the final snapshot): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    _write_atomic(root / "LATEST", name.encode())
    best = _read_pointer(root / "BEST")
    best_loss = _meta(root / best).get("val_loss") if best and (root / best).exists() else None
    if val_loss is not None and (best_loss is None or val_loss <= best_loss):
        _write_atomic(root / "BEST", name.encode())
    _prune(root, keep)
    return final


def _read_pointer(path: Path) -> str | None:
    return path.read_text().strip() if path.is_file() else None


def _meta(snap: Path) -> dict[str, Any]:
    return json.loads((snap / "meta.json").read_text())


def _prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` snapshots and the best one; remove the rest and stale temps."""
    protected = {_read_pointer(root / "BEST"), _read_pointer(root / "LATEST")}
    snaps = find_snapshots(root.parent)
    for snap in snaps[:-keep]:
        if snap.name not in protected:
            shutil.rmtree(snap, ignore_errors=True)
    for stale in root.glob(".tmp_*"):
        if not stale.name.endswith(f"_{os.getpid()}"):
            shutil.rmtree(stale, ignore_errors=True)


def find_snapshots(run_dir: str | Path) -> list[Path]:
    """Complete snapshot directories of a run, oldest first."""
    root = Path(run_dir) / "snapshots"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / "meta.json").is_file())


def check_shard_files(snap: str | Path, meta: dict[str, Any] | None = None) -> Path:
    """The shard directory of FSDP snapshot `snap`, after checking every listed file is whole.

    `meta` is the snapshot's meta.json, read here when not given.
    """
    snap = Path(snap)
    shards = snap / SHARDS
    expected = (meta if meta is not None else _meta(snap)).get("shard_files") or {}
    bad = [
        n
        for n, size in expected.items()
        if not (shards / n).is_file() or (shards / n).stat().st_size != size
    ]
    if not expected or bad:
        raise SnapshotError(
            f"{snap}: FSDP shard files missing or truncated ({', '.join(bad) or 'none listed'})"
        )
    return shards


def _verify(snap: Path) -> dict[str, Any]:
    """Load one snapshot after checking its checksum; raise SnapshotError if it is damaged."""
    try:
        meta = _meta(snap)
    except (OSError, ValueError) as e:
        raise SnapshotError(f"{snap}: unreadable meta.json ({e})") from e
    state = snap / "state.pt"
    if not state.is_file() or _sha256(state) != meta.get("sha256"):
        raise SnapshotError(f"{snap}: state.pt is missing or its checksum does not match")
    if meta.get("sharded"):
        check_shard_files(snap, meta)
    try:
        payload = torch.load(state, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        raise SnapshotError(
            f"{snap}: state.pt holds something other than tensors and plain data, which "
            f"isotrain never loads (weights_only=True): {str(e).splitlines()[-1]}"
        ) from e
    if payload.get("format_version") != FORMAT_VERSION:
        raise SnapshotError(
            f"{snap}: format version {payload.get('format_version')} is not "
            f"{FORMAT_VERSION}; resume it with the isotrain version that wrote it"
        )
    return payload


def load_snapshot(run_dir: str | Path, *, which: str = "latest") -> tuple[dict[str, Any], Path]:
    """The newest intact snapshot (`latest`) or the best-validation one (`best`).

    A damaged snapshot is reported with a warning and the previous good one is used.
    """
    root = Path(run_dir) / "snapshots"
    snaps = find_snapshots(run_dir)
    if not snaps:
        raise SnapshotError(f"{run_dir}: no snapshot found (looked in {root})")
    pointer = _read_pointer(root / ("BEST" if which == "best" else "LATEST"))
    order = [root / pointer] if pointer and (root / pointer).exists() else []
    order += [s for s in reversed(snaps) if s not in order]
    errors = []
    for snap in order:
        try:
            return _verify(snap), snap
        except SnapshotError as e:
            log.warning("skipping damaged snapshot: %s", e)
            errors.append(str(e))
    raise SnapshotError(f"{run_dir}: every snapshot is damaged:\n  " + "\n  ".join(errors))
