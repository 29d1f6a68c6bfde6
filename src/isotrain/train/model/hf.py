"""GPT-2 in Hugging Face layout, both ways: isotrain's GPT is GPT-2's architecture.

Same blocks (pre-LayerNorm, eps 1e-5, fused q|k|v, learned positions, tied head), so only the
names and the layout differ: GPT-2's `Conv1D` stores weights as (in, out), nn.Linear as
(out, in). GELU is exact in isotrain by default (exported as `activation_function: gelu`)
and tanh-approximated in GPT-2's own checkpoints (read back as `--model.gelu tanh`). A model
without biases exports zero biases, which computes the same function. Nothing here imports
`transformers`: config.json is plain JSON and the weights are safetensors.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from isotrain.train.data.sources import DataError
from isotrain.train.data.tokenizer import HFTokenizer, Tokenizer, tokenizers_module
from isotrain.train.model.gpt import GPT, GPTConfig

__all__ = ["from_gpt2_state", "gpt2_config", "read_hf_folder", "to_gpt2_state"]

# (isotrain name, GPT-2 name, stored transposed by Conv1D) for each block's parameters
_BLOCK = (
    ("ln1.weight", "ln_1.weight", False),
    ("ln1.bias", "ln_1.bias", False),
    ("attn.qkv.weight", "attn.c_attn.weight", True),
    ("attn.qkv.bias", "attn.c_attn.bias", False),
    ("attn.proj.weight", "attn.c_proj.weight", True),
    ("attn.proj.bias", "attn.c_proj.bias", False),
    ("ln2.weight", "ln_2.weight", False),
    ("ln2.bias", "ln_2.bias", False),
    ("mlp.fc.weight", "mlp.c_fc.weight", True),
    ("mlp.fc.bias", "mlp.c_fc.bias", False),
    ("mlp.proj.weight", "mlp.c_proj.weight", True),
    ("mlp.proj.bias", "mlp.c_proj.bias", False),
)
_TOP = (
    ("wte.weight", "wte.weight"),
    ("wpe.weight", "wpe.weight"),
    ("ln_f.weight", "ln_f.weight"),
    ("ln_f.bias", "ln_f.bias"),
)
_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # tanh GELU under several names
_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal masks old GPT-2 files carry


def _pairs(n_layer: int) -> list[tuple[str, str, bool]]:
    out = [(ours, f"transformer.{theirs}", False) for ours, theirs in _TOP]
    for i in range(n_layer):
        out += [(f"blocks.{i}.{o}", f"transformer.h.{i}.{t}", tr) for o, t, tr in _BLOCK]
    return out


def _bias_like(name: str, state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The zero bias a bias-free layer stands for (its size is the weight's output size)."""
    weight = state[name.removesuffix("bias") + "weight"]
    return torch.zeros(weight.shape[0], dtype=weight.dtype)


def to_gpt2_state(model: GPT) -> dict[str, torch.Tensor]:
    """GPT-2 names and layouts (contiguous copies; the tied head is stored once, as wte)."""
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    out = {}
    for ours, theirs, transposed in _pairs(model.cfg.n_layer):
        t = state[ours] if ours in state else _bias_like(ours, state)
        out[theirs] = (t.t() if transposed else t).contiguous().clone()
    return out


def gpt2_config(cfg: GPTConfig, *, dtype: str = "float32") -> dict[str, Any]:
    """`config.json` for transformers' GPT2LMHeadModel computing what `GPT(cfg)` computes."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,
        "activation_function": "gelu_new" if cfg.gelu == "tanh" else "gelu",
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "dtype": dtype,
    }


def _refuse(folder: Path, what: str) -> DataError:
    return DataError(f"{folder}: {what}; isotrain reads GPT-2-architecture checkpoints only")


def _model_config(folder: Path, raw: dict[str, Any]) -> GPTConfig:
    """The GPTConfig of a GPT-2 config.json, or a DataError naming what cannot map."""
    if raw.get("model_type") != "gpt2":
        raise _refuse(folder, f"model_type is {raw.get('model_type')!r}, not 'gpt2'")
    act = raw.get("activation_function", "gelu_new")
    checks = {
        f"activation_function {act!r}": act == "gelu" or act in _TANH,
        f"n_inner {raw.get('n_inner')}": raw.get("n_inner") in (None, 4 * raw["n_embd"]),
        "layer_norm_epsilon": math.isclose(raw.get("layer_norm_epsilon", 1e-5), 1e-5),
        "scale_attn_weights false": raw.get("scale_attn_weights", True),
        "scale_attn_by_inverse_layer_idx": not raw.get("scale_attn_by_inverse_layer_idx"),
        "untied lm_head": raw.get("tie_word_embeddings", True),
        "cross-attention": not raw.get("add_cross_attention"),
    }
    bad = [name for name, ok in checks.items() if not ok]
    if bad:
        raise _refuse(folder, "unsupported settings: " + ", ".join(bad))
    return GPTConfig(
        n_layer=int(raw["n_layer"]),
        n_head=int(raw["n_head"]),
        d_model=int(raw["n_embd"]),
        block_size=int(raw["n_positions"]),
        vocab_size=int(raw["vocab_size"]),
        bias=True,
        gelu="exact" if act == "gelu" else "tanh",
    )


def from_gpt2_state(
    state: dict[str, torch.Tensor], cfg: GPTConfig, *, where: str = "checkpoint"
) -> dict[str, torch.Tensor]:
    """isotrain's state dict from GPT-2's (with or without the `transformer.` prefix)."""
    theirs = {
        (k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}"): v
        for k, v in state.items()
        if not k.endswith(_BUFFERS)
    }
    out, used = {}, set()
    for ours, name, transposed in _pairs(cfg.n_layer):
        if name not in theirs:
            raise DataError(f"{where}: tensor {name} is missing; is it a GPT-2 checkpoint?")
        out[ours] = theirs[name].t().contiguous() if transposed else theirs[name]
        used.add(name)
    head = theirs.get("lm_head.weight")
    if head is not None and not torch.equal(head, theirs["transformer.wte.weight"]):
        raise DataError(f"{where}: lm_head differs from wte; isotrain ties them")
    extra = sorted(set(theirs) - used - {"lm_head.weight"})
    if extra:
        raise DataError(f"{where}: tensors isotrain's GPT has no place for: {extra[:5]}")
    out["lm_head.weight"] = out["wte.weight"]
    return out


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, or the shards model.safetensors.index.json lists (never pickle)."""
    from safetensors.torch import load_file

    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return dict(load_file(str(single)))
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if any(Path(f).name != f for f in files):
            raise DataError(f"{index}: shard names must be plain file names in {folder}")
        return {k: v for f in files for k, v in load_file(str(folder / f)).items()}
    raise FileNotFoundError(
        f"{folder}: no model.safetensors; isotrain reads safetensors only (never pickled "
        "pytorch_model.bin): save it with save_pretrained(folder, safe_serialization=True)"
    )


def _folder_tokenizer(folder: Path) -> Tokenizer | None:
    """tokenizer.json, or GPT-2's vocab.json + merges.txt, or None when the folder has neither."""
    if (folder / "tokenizer.json").is_file():
        return HFTokenizer.from_file(folder / "tokenizer.json")
    vocab, merges = folder / "vocab.json", folder / "merges.txt"
    if not (vocab.is_file() and merges.is_file()):
        return None
    tk = tokenizers_module()
    tok = tk.Tokenizer(tk.models.BPE.from_file(str(vocab), str(merges)))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    return HFTokenizer(tok, source=f"{folder} (vocab.json + merges.txt)")


def read_hf_folder(folder: str | Path) -> tuple[GPT, Tokenizer | None]:
    """The GPT (CPU, fp32) and tokenizer of a GPT-2 folder saved by transformers or export."""
    root = Path(folder).expanduser()
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"hf:{folder}: no config.json there; is it a model folder?")
    cfg = _model_config(root, json.loads((root / "config.json").read_text(encoding="utf-8")))
    model = GPT(cfg)
    state = {k: v.float() for k, v in _read_weights(root).items()}
    model.load_state_dict(from_gpt2_state(state, cfg, where=str(root)))
    return model, _folder_tokenizer(root)
