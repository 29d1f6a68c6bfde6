"""A Hugging Face GPT-2 folder (`hf:FOLDER`) read as isotrain's GPT, checked first.

config.json is untrusted input: it passes the CLI's model rules (under GPT-2's names), then
every safetensors header in the folder is read and each tensor compared with the shapes that
config implies, before the model is built or a weight is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from isotrain.train.config import ModelConfig
from isotrain.train.data.tokenizer import Tokenizer
from isotrain.train.model.gpt import GPT
from isotrain.train.model.hf import (
    GPT2_NAMES,
    check_gpt2_settings,
    folder_tokenizer,
    from_gpt2_state,
    gpt2_fields,
    gpt2_name,
    gpt2_shapes,
)
from isotrain.train.weights.checks import check_tensors, model_config
from isotrain.train.weights.header import (
    SafetensorsHeader,
    WeightsFileError,
    json_kind,
    library_errors,
    read_header,
)

__all__ = ["read_hf_folder"]

_FIX = "fix it, or save the model again with save_pretrained(folder, safe_serialization=True)"
_THEIRS = {ours: theirs for ours, theirs in GPT2_NAMES.items() if ours != theirs}


def _json(path: Path) -> Any:
    """A JSON file of the folder, or a one-line error naming it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        reason = "nested too deep" if isinstance(e, RecursionError) else str(e)
        raise WeightsFileError(f"{path}: not JSON ({reason}); {_FIX}") from None


def _shard_names(index: Path) -> list[str]:
    """The shard files model.safetensors.index.json lists (plain names in its folder)."""
    raw = _json(index)
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise WeightsFileError(
            f"{index}: its weight_map is not an object of tensor -> file names; {_FIX}"
        )
    files = sorted(set(weight_map.values()))
    if any(Path(f).name != f or f in ("", ".", "..") for f in files):
        raise WeightsFileError(f"{index}: shard names must be plain file names in its folder")
    return files


def _headers(folder: Path) -> list[SafetensorsHeader]:
    """model.safetensors, or the shards its index lists, each header checked (never pickle)."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return [read_header(single)]
    if index.is_file():
        return [read_header(folder / f) for f in _shard_names(index)]
    raise FileNotFoundError(
        f"{folder}: no model.safetensors; isotrain reads safetensors only (never pickled "
        "pytorch_model.bin): save it with save_pretrained(folder, safe_serialization=True)"
    )


def _config(root: Path) -> tuple[ModelConfig, list[SafetensorsHeader]]:
    """The folder's checked model config and the checked headers of its weight files."""
    path = root / "config.json"
    raw = _json(path)
    if not isinstance(raw, dict):
        raise WeightsFileError(f"{path}: a JSON {json_kind(raw)}, not an object; {_FIX}")
    cfg = model_config(gpt2_fields(root, raw), str(path), fix=_FIX, names=_THEIRS)
    check_gpt2_settings(root, raw, cfg)
    headers = _headers(root)
    found = {}
    for h in headers:
        for key, t in h.tensors.items():
            name = gpt2_name(key)
            if name is not None and name in found:
                raise WeightsFileError(f"{h.path}: tensor {key!r} is also in another shard")
            found[name or key] = t
    check_tensors(
        str(root),
        found,
        cfg,
        shapes=gpt2_shapes,
        ties=("transformer.wte.weight", "lm_head.weight"),
        ignore=lambda name: gpt2_name(name) is None,
    )
    return cfg, headers


def read_hf_folder(folder: str | Path) -> tuple[GPT, Tokenizer | None]:
    """The GPT (CPU, fp32) and tokenizer of a GPT-2 folder saved by transformers or export."""
    from safetensors.torch import load_file

    root = Path(folder).expanduser()
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"hf:{folder}: no config.json there; is it a model folder?")
    cfg, headers = _config(root)
    tok = folder_tokenizer(root)
    state: dict[str, torch.Tensor] = {}
    for h in headers:
        with library_errors(h.path):
            state.update({k: v.float() for k, v in load_file(str(h.path)).items()})
    model = GPT(cfg)
    model.load_state_dict(from_gpt2_state(state, cfg, where=str(root)))
    return model, tok
