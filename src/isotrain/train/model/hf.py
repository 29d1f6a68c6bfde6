"""GPT-2 in Hugging Face layout, both ways: isotrain's GPT is GPT-2's architecture.

Same blocks (pre-LayerNorm, eps 1e-5, fused q|k|v, learned positions, tied head), so only the
names and the layout differ: GPT-2's `Conv1D` stores weights as (in, out), nn.Linear as
(out, in). GELU is exact in isotrain by default (exported as `activation_function: gelu`)
and tanh-approximated in GPT-2's own checkpoints (read back as `--model.gelu tanh`). A model
without biases exports zero biases, which computes the same function. Nothing here imports
`transformers`: config.json is plain JSON and the weights are safetensors.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from isotrain.train.data.sources import DataError
from isotrain.train.data.tokenizer import HFTokenizer, Tokenizer, tokenizers_module
from isotrain.train.model.gpt import GPT, GPTConfig

__all__ = [
    "GPT2_NAMES",
    "check_gpt2_settings",
    "folder_tokenizer",
    "from_gpt2_state",
    "gpt2_config",
    "gpt2_fields",
    "gpt2_name",
    "gpt2_shapes",
    "to_gpt2_state",
]

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
    return torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device)


def to_gpt2_state(model: GPT) -> dict[str, torch.Tensor]:
    """GPT-2 names and layouts (contiguous copies; the tied head is stored once, as wte)."""
    c = model.cfg
    other = [
        what
        for what, differs in (
            ("--model.positions rotary", c.positions != "learned"),
            ("--model.qk-norm", c.qk_norm),
            ("--model.activation relu2", c.activation != "gelu"),
            ("--model.no-tie-head", not c.tie_head),
        )
        if differs
    ]
    if other:
        raise DataError(
            f"GPT-2's layout has no place for {', '.join(other)}; export this model as isotrain's "
            "own .safetensors instead"
        )
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


# GPTConfig field -> its name in GPT-2's config.json (each one required there)
GPT2_NAMES = {
    "n_layer": "n_layer",
    "n_head": "n_head",
    "d_model": "n_embd",
    "block_size": "n_positions",
    "vocab_size": "vocab_size",
}


def gpt2_fields(folder: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """The GPTConfig fields a GPT-2 config.json names, as written there (the caller checks
    their types and ranges); a DataError when it is not GPT-2 or lacks one."""
    if raw.get("model_type") != "gpt2":
        raise _refuse(folder, f"model_type is {raw.get('model_type')!r}, not 'gpt2'")
    missing = [theirs for theirs in GPT2_NAMES.values() if theirs not in raw]
    if missing:
        raise _refuse(folder, "config.json has no " + ", ".join(missing))
    act = raw.get("activation_function", "gelu_new")
    fields = {ours: raw[theirs] for ours, theirs in GPT2_NAMES.items()}
    return {**fields, "bias": True, "gelu": "exact" if act == "gelu" else "tanh"}


def check_gpt2_settings(folder: Path, raw: dict[str, Any], cfg: GPTConfig) -> None:
    """Refuse, by name, every GPT-2 setting isotrain's GPT does not compute the same way."""
    act, eps = raw.get("activation_function", "gelu_new"), raw.get("layer_norm_epsilon", 1e-5)
    checks = {
        f"activation_function {act!r}": act == "gelu" or act in _TANH,
        f"n_inner {raw.get('n_inner')!r}": raw.get("n_inner") in (None, 4 * cfg.d_model),
        f"layer_norm_epsilon {eps!r}": type(eps) in (int, float) and math.isclose(eps, 1e-5),
        "scale_attn_weights false": raw.get("scale_attn_weights", True),
        "scale_attn_by_inverse_layer_idx": not raw.get("scale_attn_by_inverse_layer_idx"),
        "untied lm_head": raw.get("tie_word_embeddings", True),
        "cross-attention": not raw.get("add_cross_attention"),
    }
    bad = [name for name, ok in checks.items() if not ok]
    if bad:
        raise _refuse(folder, "unsupported settings: " + ", ".join(bad))


def gpt2_name(key: str) -> str | None:
    """A GPT-2 tensor name with its `transformer.` prefix; None for the causal-mask buffers."""
    if key.endswith(_BUFFERS):
        return None
    return key if key.startswith(("transformer.", "lm_head.")) else f"transformer.{key}"


def gpt2_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor a GPT-2 checkpoint of `cfg` holds (lm_head: wte's), computed
    on the meta device, so no memory is taken whatever `cfg` asks for."""
    with torch.device("meta"):
        state = GPT(cfg).state_dict()
    out = {}
    for ours, theirs, transposed in _pairs(cfg.n_layer):
        # a bias-free model exports zero biases, sized as the weight's output
        held = state[ours] if ours in state else _bias_like(ours, state)
        out[theirs] = tuple(held.shape)[::-1] if transposed else tuple(held.shape)
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def from_gpt2_state(
    state: dict[str, torch.Tensor], cfg: GPTConfig, *, where: str = "checkpoint"
) -> dict[str, torch.Tensor]:
    """isotrain's state dict from GPT-2's (with or without the `transformer.` prefix)."""
    theirs = {name: v for k, v in state.items() if (name := gpt2_name(k)) is not None}
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


def folder_tokenizer(folder: Path) -> Tokenizer | None:
    """tokenizer.json, or GPT-2's vocab.json + merges.txt, or None when the folder has neither."""
    if (folder / "tokenizer.json").is_file():
        return HFTokenizer.from_file(folder / "tokenizer.json")
    vocab, merges = folder / "vocab.json", folder / "merges.txt"
    if not (vocab.is_file() and merges.is_file()):
        return None
    tk = tokenizers_module()
    try:
        tok = tk.Tokenizer(tk.models.BPE.from_file(str(vocab), str(merges)))
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        raise DataError(
            f"{folder}: vocab.json + merges.txt are not a BPE ({e}); save the tokenizer again"
        ) from None
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    return HFTokenizer(tok, source=f"{folder} (vocab.json + merges.txt)")
