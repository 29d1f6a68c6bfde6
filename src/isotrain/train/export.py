"""Weights alone, in safetensors format: no code, no optimizer, just the model and its shape."""

from __future__ import annotations

import json
from pathlib import Path

from isotrain.train.config import ModelConfig, TrainConfig
from isotrain.train.model import GPT

__all__ = ["export_run", "export_safetensors", "load_safetensors"]


def _safetensors():
    try:
        import safetensors.torch as st
    except ImportError as e:
        raise ImportError("export needs safetensors: pip install 'isotrain[export]'") from e
    return st


def export_safetensors(model: GPT, out: str | Path) -> Path:
    """Write `model`'s weights and its config (as metadata) to `out`."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"isotrain_model_config": json.dumps(model.cfg.__dict__)}
    _safetensors().save_model(model, str(out), metadata=meta)  # drops the tied duplicate
    return out


def load_safetensors(path: str | Path) -> GPT:
    """Rebuild the GPT from an exported file (on the CPU)."""
    from safetensors import safe_open

    from isotrain.train.loop import build_model

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "isotrain_model_config" not in meta:
        raise ValueError(f"{path}: not an isotrain export (no isotrain_model_config metadata)")
    cfg = ModelConfig(**json.loads(meta["isotrain_model_config"]))
    model = build_model(TrainConfig(model=cfg))
    _safetensors().load_model(model, str(path))
    return model


def export_run(run_dir: str, out: str | Path, *, which: str = "latest") -> tuple[Path, Path]:
    """Export the weights of a run's snapshot; returns the file and the snapshot it came from."""
    from isotrain.train.loop import model_from_snapshot
    from isotrain.train.snapshot import load_snapshot

    payload, snap = load_snapshot(run_dir, which=which)
    return export_safetensors(model_from_snapshot(payload, snap), out), snap
