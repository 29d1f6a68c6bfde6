"""Weights alone, in safetensors format: no code, no optimizer, just the model and its shape."""

from __future__ import annotations

import json
from pathlib import Path

from isotrain.train.model import GPT
from isotrain.train.snapshot import load_snapshot
from isotrain.train.weights import model_from_snapshot, safetensors_module

__all__ = ["export_run", "export_safetensors"]


def export_safetensors(model: GPT, out: str | Path) -> Path:
    """Write `model`'s weights and its config (as metadata) to `out`."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"isotrain_model_config": json.dumps(model.cfg.__dict__)}
    safetensors_module().save_model(model, str(out), metadata=meta)  # drops the tied duplicate
    return out


def export_run(run_dir: str, out: str | Path, *, which: str = "latest") -> tuple[Path, Path]:
    """Export the weights of a run's snapshot; returns the file and the snapshot it came from."""
    payload, snap = load_snapshot(run_dir, which=which)
    return export_safetensors(model_from_snapshot(payload, snap), out), snap
