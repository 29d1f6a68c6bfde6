"""Models and their tokenizers from configs, snapshots, exported files and Hugging Face folders:
where `sample`, `export` and `--init-from` get weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from isotrain.train.config import ModelConfig
from isotrain.train.data.tokenizer import Tokenizer, from_metadata, run_tokenizer
from isotrain.train.model.gpt import GPT
from isotrain.train.model.hf import read_hf_folder
from isotrain.train.rundir.sharded import load_full_model
from isotrain.train.rundir.snapshot import load_snapshot

__all__ = [
    "build_model",
    "load_model",
    "load_safetensors",
    "load_with_tokenizer",
    "model_from_snapshot",
    "read_safetensors",
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


def load_with_tokenizer(source: str, *, which: str = "latest") -> tuple[GPT, Tokenizer | None]:
    """The GPT (CPU) and tokenizer of a run directory, an isotrain `.safetensors` file or
    `hf:FOLDER` (a GPT-2 folder; its tokenizer is None when it holds no tokenizer files)."""
    if source.startswith("hf:"):
        return read_hf_folder(source.removeprefix("hf:"))
    if source.endswith(".safetensors"):
        return read_safetensors(source)
    payload, snap = load_snapshot(source, which=which)
    return model_from_snapshot(payload, snap), run_tokenizer(source, payload["config"])


def load_model(source: str, *, which: str = "latest") -> GPT:
    """The GPT of a run directory's snapshot, an exported `.safetensors` file or `hf:FOLDER`."""
    return load_with_tokenizer(source, which=which)[0]


def safetensors_module() -> Any:
    """`safetensors.torch`, or an ImportError that says how to install it."""
    try:
        import safetensors.torch as st
    except ImportError as e:
        raise ImportError("export needs safetensors: pip install 'isotrain[export]'") from e
    return st


def load_safetensors(path: str | Path) -> GPT:
    """Rebuild the GPT from an exported file (on the CPU)."""
    return read_safetensors(path)[0]


def read_safetensors(path: str | Path) -> tuple[GPT, Tokenizer | None]:
    """The GPT (CPU) and tokenizer of an isotrain export; a GPT-2 `model.safetensors` with
    config.json beside it is read as `hf:` its folder."""
    from safetensors import safe_open

    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    with safe_open(str(p), framework="pt") as f:
        meta = f.metadata() or {}
    if "isotrain_model_config" not in meta:
        if (p.parent / "config.json").is_file():
            return read_hf_folder(p.parent)
        raise ValueError(f"{path}: not an isotrain export (no isotrain_model_config metadata)")
    model = build_model(ModelConfig(**json.loads(meta["isotrain_model_config"])))
    safetensors_module().load_model(model, str(p))
    return model, from_metadata(meta.get("isotrain_tokenizer"), model.cfg.vocab_size)
