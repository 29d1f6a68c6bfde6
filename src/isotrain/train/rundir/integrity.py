"""Is a snapshot whole, ours and harmless? A run directory is untrusted input.

Every file of a snapshot is listed in its meta.json with a sha256 and checked before anything
reads it; every name read from the directory (LATEST, BEST, the manifest, DCP storage paths)
must stay inside it; and the payload must have the structure the trainer writes. Anything
else raises `SnapshotError`, which `load_snapshot` turns into one warning and a fallback.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from isotrain.train.config import ModelConfig
from isotrain.train.fields import check_value, hints
from isotrain.train.model.gpt import GPT

__all__ = [
    "SnapshotError",
    "check_payload",
    "contained",
    "manifest",
    "one_line",
    "read_meta",
    "read_pointer",
    "sha256",
    "verify_files",
]

log = logging.getLogger(__name__)

SNAPSHOT_NAME = re.compile(r"step_[0-9]{7,19}")
META_LIMIT = 64 << 20  # bytes: a manifest of every shard of a large run is far smaller
FORMAT_VERSIONS = (1, 2)  # 1: meta.json checksummed state.pt only; 2: every file


class SnapshotError(RuntimeError):
    """No usable snapshot: the message says which were tried and why they failed."""


def one_line(e: BaseException) -> str:
    """The last line of an exception's message (torch's are often several lines long)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__


def sha256(path: Path) -> str:
    """Hex digest of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def contained(path: Path, root: Path) -> bool:
    """True when `path`, with every link resolved, is `root` or lies under it."""
    return path.resolve().is_relative_to(root.resolve())


def read_pointer(path: Path) -> str | None:
    """The snapshot name a pointer file (LATEST, BEST) holds; None, with one warning, when it
    holds anything else (a path, bytes that are not text, a link)."""
    if not path.is_file() and not path.is_symlink():
        return None
    raw = b""
    if not path.is_symlink():
        with path.open("rb") as f:
            raw = f.read(64)  # a snapshot name is 12-24 bytes: never read a planted giant
    name = raw.decode("ascii", errors="replace").strip()
    if SNAPSHOT_NAME.fullmatch(name):
        return name
    log.warning("%s holds %r, not the name of a snapshot of this run: ignoring it", path, raw)
    return None


def read_meta(snap: Path) -> dict[str, Any]:
    """A snapshot's meta.json, which must be a JSON object."""
    path = snap / "meta.json"
    if path.is_symlink() or not path.is_file():
        raise SnapshotError(f"{snap}: meta.json is missing or a link")
    try:  # a pruner may rename the snapshot away at any point: that too is one SnapshotError
        size = path.stat().st_size
        if size > META_LIMIT:
            raise SnapshotError(f"{snap}: meta.json is {size} bytes, too big to be one")
        meta = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as e:
        raise SnapshotError(f"{snap}: unreadable meta.json ({one_line(e)})") from None
    if not isinstance(meta, dict):
        raise SnapshotError(f"{snap}: meta.json holds {type(meta).__name__}, not an object")
    return meta


def _safe_name(rel: Any) -> bool:
    """A relative path inside the snapshot: no `..`, not absolute, no empty parts."""
    if not isinstance(rel, str) or not rel or "\\" in rel or "\0" in rel:
        return False
    p = PurePosixPath(rel)
    return not p.is_absolute() and all(part not in ("", ".", "..") for part in p.parts)


def manifest(meta: dict[str, Any], snap: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file the snapshot holds, from its meta.json."""
    version = meta.get("format_version")
    if version not in FORMAT_VERSIONS:
        raise SnapshotError(
            f"{snap}: format version {version!r} is not one of {FORMAT_VERSIONS}; resume it "
            "with the isotrain version that wrote it"
        )
    files = meta.get("files")
    if version == 1 and not meta.get("sharded"):
        files = {"state.pt": meta.get("sha256")}
    if (
        not isinstance(files, dict)
        or "state.pt" not in files
        or not all(_safe_name(k) and isinstance(v, str) for k, v in files.items())
    ):
        raise SnapshotError(f"{snap}: meta.json has no valid list of checksummed files")
    return files


def verify_files(snap: Path, files: dict[str, str]) -> None:
    """Check every listed file: a regular file inside the snapshot, with its sha256."""
    for rel, digest in files.items():
        path = snap / rel
        if path.is_symlink() or not path.is_file() or not contained(path, snap):
            raise SnapshotError(f"{snap}: {rel} is missing, a link, or not a regular file")
        try:
            actual = sha256(path)
        except OSError as e:  # gone since the check above (pruned), or unreadable
            raise SnapshotError(f"{snap}: {rel} could not be read ({one_line(e)})") from None
        if actual != digest:
            raise SnapshotError(f"{snap}: {rel} is damaged: its checksum does not match")


SECTIONS = {"config": dict, "train_state": dict, "updater": dict, "rng": dict}


def check_payload(payload: dict[str, Any], snap: Path) -> None:
    """Raise SnapshotError unless `payload` has the structure `resume.save_run` writes, with a
    model config that builds and (unsharded) weights of exactly that model's shapes."""
    sections = dict(SECTIONS)
    if not payload.get("sharded"):
        sections.update(model=dict, optimizer=dict)
    for key, kind in sections.items():
        if not isinstance(payload.get(key), kind):
            raise SnapshotError(f"{snap}: state.pt has no valid {key!r} section")
    saved = payload["config"].get("model")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    if not isinstance(saved, dict) or set(saved) != fields:
        raise SnapshotError(f"{snap}: state.pt holds no valid model config")
    for name, value in saved.items():
        if check_value(value, hints(ModelConfig)[name]) is not None:
            raise SnapshotError(f"{snap}: state.pt's model config has {name} = {value!r}")
    if not payload.get("sharded"):
        _check_weights(payload["model"], ModelConfig(**saved), snap)


def _check_weights(state: dict[str, Any], cfg: ModelConfig, snap: Path) -> None:
    """Every weight the model of `cfg` has, with its shape, and nothing else."""
    try:
        with torch.device("meta"):  # shapes only: nothing is allocated
            expected = {k: v.shape for k, v in GPT(cfg).state_dict().items()}
    except (ValueError, RuntimeError, AssertionError) as e:
        raise SnapshotError(f"{snap}: its model config does not build ({one_line(e)})") from None
    got = {k: v.shape for k, v in state.items() if isinstance(v, torch.Tensor)}
    if got != expected:
        wrong = sorted(set(got) ^ set(expected)) or [k for k in got if got[k] != expected[k]]
        raise SnapshotError(f"{snap}: state.pt's weights do not fit its config ({wrong[0]})")
