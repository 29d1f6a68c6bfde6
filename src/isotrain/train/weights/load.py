"""Models and their tokenizers from configs, snapshots, exported files and Hugging Face folders:
where `sample`, `export` and `--init-from` get weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from isotrain.train.config import ModelConfig
from isotrain.train.data.tokenizer import Tokenizer, from_metadata, run_tokenizer
from isotrain.train.model.gpt import GPT
from isotrain.train.rundir.sharded import load_full_model
from isotrain.train.rundir.snapshot import load_snapshot
from isotrain.train.weights.checks import check_tensors, isotrain_shapes, model_config
from isotrain.train.weights.header import (
    SafetensorsHeader,
    WeightsFileError,
    library_errors,
    read_header,
)
from isotrain.train.weights.hf_folder import read_hf_folder

__all__ = [
    "build_model",
    "load_model",
    "load_safetensors",
    "load_with_tokenizer",
    "model_from_snapshot",
    "read_safetensors",
    "safetensors_module",
]

_FIX = "try a file written by isotrain export"


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


def _tokenizer(meta: dict[str, str], cfg: ModelConfig, source: str) -> Tokenizer:
    """The tokenizer an export's metadata records, checked: readable, fits the vocabulary."""
    value = meta.get("isotrain_tokenizer")
    try:
        tok = from_metadata(value, cfg.vocab_size)
    except ImportError:  # tokenizers is not installed: the CLI names the extra
        raise
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise WeightsFileError(
            f"{source}: its isotrain_tokenizer metadata is not bytes, ids or a tokenizer's JSON "
            f"({reason}); {_FIX}"
        ) from None
    if tok.vocab_size > cfg.vocab_size:
        raise WeightsFileError(
            f"{source}: its tokenizer has {tok.vocab_size} tokens, more than the model's "
            f"vocab_size {cfg.vocab_size}; {_FIX}"
        )
    return tok


def _export_config(header: SafetensorsHeader, source: str) -> ModelConfig:
    """The checked model config of an isotrain export, matched against its tensors."""
    try:
        raw = json.loads(header.metadata["isotrain_model_config"])
    except (ValueError, RecursionError) as e:
        reason = "nested too deep" if isinstance(e, RecursionError) else str(e)
        raise WeightsFileError(
            f"{source}: its isotrain_model_config metadata is not JSON ({reason}); {_FIX}"
        ) from None
    cfg = model_config(raw, f"{source} (isotrain_model_config)", fix=_FIX)
    check_tensors(
        source, header.tensors, cfg, shapes=isotrain_shapes, ties=("wte.weight", "lm_head.weight")
    )
    return cfg


def read_safetensors(path: str | Path) -> tuple[GPT, Tokenizer | None]:
    """The GPT (CPU) and tokenizer of an isotrain export; a GPT-2 `model.safetensors` with
    config.json beside it is read as `hf:` its folder. The header, config and shapes are
    checked before the model is built (see `weights.checks`)."""
    p = Path(path).expanduser()
    header = read_header(p)
    if "isotrain_model_config" not in header.metadata:
        if (p.parent / "config.json").is_file():
            return read_hf_folder(p.parent)
        raise WeightsFileError(
            f"{path}: not an isotrain export (no isotrain_model_config metadata); {_FIX}"
        )
    cfg = _export_config(header, str(path))
    tok = _tokenizer(header.metadata, cfg, str(path))
    model = build_model(cfg)
    with library_errors(p):
        safetensors_module().load_model(model, str(p))
    return model, tok
