"""Text from a trained model through its tokenizer; every mode and global RNG left as it was."""

from __future__ import annotations

import math

import numpy as np
import torch

from isotrain.contexts import eval_mode
from isotrain.train.data.tokenizer import ByteTokenizer, Tokenizer
from isotrain.train.fields import ConfigError
from isotrain.train.model.gpt import GPT

__all__ = ["check_sampling", "prompt_from", "sample", "samples"]


def check_sampling(
    *,
    tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    num_samples: int = 1,
) -> None:
    """Refuse a sampling setting that cannot work, naming the flag and a value that does."""
    checks = [
        (tokens >= 0, "--tokens", tokens, "use 0 or more", "200"),
        (
            math.isfinite(temperature) and temperature >= 0,
            "--temperature",
            temperature,
            "use a finite number >= 0 (0 picks the most likely token)",
            "0.7",
        ),
        (top_k is None or top_k >= 1, "--top-k", top_k, "use 1 or more, or None (all)", "50"),
        (
            top_p is None or 0 < top_p <= 1,
            "--top-p",
            top_p,
            "use a probability in (0, 1], or None (off)",
            "0.9",
        ),
        (num_samples >= 1, "--num-samples", num_samples, "use 1 or more", "3"),
    ]
    for ok, name, value, fix, example in checks:
        if not ok:
            raise ConfigError(f"{name} {value} is invalid: {fix}; try {name} {example}")


def samples(
    model: GPT,
    prompt: str,
    max_new_tokens: int,
    *,
    tokenizer: Tokenizer | None = None,
    temperature: float = 0.7,
    top_k: int | None = 50,
    top_p: float | None = None,
    num_samples: int = 1,
    seed: int = 0,
) -> list[str]:
    """`num_samples` continuations of `prompt` (one batch); modes and global RNGs untouched."""
    check_sampling(
        tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        num_samples=num_samples,
    )
    tok = tokenizer or ByteTokenizer()
    device = next(model.parameters()).device
    ids = tok.encode(prompt) or tok.encode("\n") or [0]
    idx = torch.tensor([ids] * num_samples, dtype=torch.long, device=device)  # (N, T)
    gen = torch.Generator(device=device).manual_seed(seed)
    # Every prompt length is a new shape: run compiled blocks eagerly rather than recompile.
    with eval_mode(model), torch.compiler.set_stance("force_eager"):
        out = model.generate(
            idx, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, generator=gen
        )
    return [tok.decode(row[idx.size(1) :]) for row in out]


def sample(
    model: GPT,
    prompt: str,
    max_new_tokens: int,
    *,
    tokenizer: Tokenizer | None = None,
    temperature: float = 0.7,
    top_k: int | None = 50,
    top_p: float | None = None,
    seed: int = 0,
) -> str:
    """Text generated from `prompt`; leaves modes and every global RNG as they were."""
    return samples(
        model,
        prompt,
        max_new_tokens,
        tokenizer=tokenizer,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
    )[0]


def prompt_from(
    tokens: np.ndarray, tokenizer: Tokenizer, *, seed: int, window: int = 256, lines: int = 4
) -> str:
    """A few whole lines from `tokens` (e.g. the validation split) at a seeded position: a
    prompt in the corpus's own style, so the sample shows what the model learned of it."""
    if len(tokens) <= window:
        return tokenizer.decode(torch.as_tensor(np.asarray(tokens[:window], dtype=np.int64)))
    start = int(np.random.default_rng(seed).integers(0, len(tokens) - window))
    piece = np.asarray(tokens[start : start + window], dtype=np.int64)
    text = tokenizer.decode(torch.as_tensor(piece))
    cut = text.split("\n")[1:-1]  # the first and last lines may be cut
    whole = [ln for ln in cut if ln.strip()][:lines]
    return "\n".join(whole) + "\n" if whole else text
