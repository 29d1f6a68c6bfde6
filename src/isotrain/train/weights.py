"""Models from configs, snapshots and exported files: where `sample` and `export` get weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from isotrain.train.config import ModelConfig
from isotrain.train.dist_snapshot import load_full_model
from isotrain.train.model import GPT
from isotrain.train.snapshot import load_snapshot

__all__ = [
    "build_model",
    "load_model",
    "load_safetensors",
    "model_from_snapshot",
    "safetensors_module",
]


def build_model(cfg: ModelConfig) -> GPT:
    """The GPT of `cfg` (on the CPU, in fp32)."""
    return GPT(cfg)


def model_from_snapshot(payload: dict[str, Any], path: Path) -> GPT:
    """The GPT a loaded snapshot describes, with its weights (on the CPU)."""
    model = build_model(ModelConfig(**payload["config"]["model"]))
    if payload.get("sharded"):  # an FSDP run: gather every rank's shards into one model
        load_full_model(path, model)
        return model
    model.load_state_dict(payload["model"])
    return model


def load_model(source: str, *, which: str = "latest") -> GPT:
    """The GPT of a run directory's snapshot or of an exported `.safetensors` file (CPU)."""
    if source.endswith(".safetensors"):
        return load_safetensors(source)
    return model_from_snapshot(*load_snapshot(source, which=which))


def safetensors_module() -> Any:
    """`safetensors.torch`, or an ImportError that says how to install it."""
    try:
        import safetensors.torch as st
    except ImportError as e:
        raise ImportError("export needs safetensors: pip install 'isotrain[export]'") from e
    return st


def load_safetensors(path: str | Path) -> GPT:
    """Rebuild the GPT from an exported file (on the CPU)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "isotrain_model_config" not in meta:
        raise ValueError(f"{path}: not an isotrain export (no isotrain_model_config metadata)")
    model = build_model(ModelConfig(**json.loads(meta["isotrain_model_config"])))
    safetensors_module().load_model(model, str(path))
    return model
