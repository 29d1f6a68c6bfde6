"""The probe's results, cached per machine, torch version, thread count, shape and modes timed.

One file for every run on this machine (other clones and jobs included), so each entry says
when it was measured, and the header says "cached (measured DATE)" and how to measure again.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch

from isotrain.train.config import TrainConfig
from isotrain.train.files import PlantedPathError, remove_stale, replace_file
from isotrain.train.precision.capability import device_name
from isotrain.train.precision.modes import MODES

__all__ = ["cache_key", "cache_path", "read_entry", "write_entry"]

log = logging.getLogger(__name__)


def cache_path() -> Path:
    """Where probe results live: $ISOTRAIN_CACHE_DIR, else $XDG_CACHE_HOME/isotrain."""
    root = os.environ.get("ISOTRAIN_CACHE_DIR")
    if root:
        return Path(root) / "precision.json"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "isotrain" / "precision.json"


def cache_key(cfg: TrainConfig, device: torch.device) -> str:
    """What the step time depends on: device, torch, threads, shape, batch, the modes timed."""
    m = cfg.model
    parts = [
        device_name(device),
        f"torch {torch.__version__}",
        f"threads {torch.get_num_threads()}" if device.type == "cpu" else device.type,
        f"{m.n_layer}x{m.d_model}h{m.n_head} T{m.block_size} V{m.vocab_size}",
        f"B{cfg.data.batch_size}",
        "modes " + " ".join(MODES),
    ]
    return " | ".join(parts)


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError) as e:
        log.warning("ignoring the unreadable precision cache %s (%s); probing again", path, e)
        return {}


def read_entry(path: Path, key: str) -> dict[str, Any] | None:
    """The entry of `key` when it is whole (a mode, its ratios, a date), else None."""
    entry = _read(path).get(key)
    if entry is None:
        return None
    ratios = entry.get("ratios") if isinstance(entry, dict) else None
    whole = (
        isinstance(entry, dict)
        and entry.get("precision") in MODES
        and isinstance(entry.get("measured"), str)
        and isinstance(ratios, dict)
        and set(ratios) == set(MODES)
        and all(_finite(v) for v in ratios.values())
    )
    if not whole:
        log.warning("ignoring an incomplete entry of the precision cache %s; probing again", path)
        return None
    return entry


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def write_entry(path: Path, key: str, entry: dict[str, Any]) -> None:
    """Add or replace the entry of `key`; a cache that cannot be written is only a warning."""
    data = _read(path)
    data[key] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(path.parent)  # what a write killed mid-way left
        replace_file(path, json.dumps(data, indent=1, sort_keys=True))
    except (OSError, PlantedPathError) as e:  # a read-only home must not stop training
        log.warning("could not cache the precision probe in %s (%s)", path, e)
