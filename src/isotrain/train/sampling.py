"""Text from a trained model, with every mode and global RNG left as it was."""

from __future__ import annotations

import torch

from isotrain.contexts import eval_mode
from isotrain.train import data as data_mod
from isotrain.train.model import GPT

__all__ = ["sample"]


def sample(
    model: GPT,
    prompt: str,
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
) -> str:
    """Text generated from `prompt`; leaves modes and every global RNG as they were."""
    tok = data_mod.ByteTokenizer()
    device = next(model.parameters()).device
    idx = torch.tensor([tok.encode(prompt) or [10]], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    # Every prompt length is a new shape: run compiled blocks eagerly rather than recompile.
    with eval_mode(model), torch.compiler.set_stance("force_eager"):
        out = model.generate(
            idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=gen
        )
    return tok.decode(out[0, idx.size(1) :])
