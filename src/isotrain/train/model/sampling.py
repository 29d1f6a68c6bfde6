"""Text from a trained model through its tokenizer; every mode and global RNG left as it was."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from isotrain.contexts import eval_mode
from isotrain.train.data.tokenizer import ByteTokenizer, Tokenizer
from isotrain.train.fields import ConfigError
from isotrain.train.model.gpt import GPT

__all__ = ["MAX_WHITESPACE", "check_sampling", "prompt_from", "sample", "samples"]

# NOTE [whitespace runs]
# A small model sampled at a low temperature or with top-p can fall into a run of spaces it
# never leaves: the more of its context is spaces, the likelier the next space, and the rest
# of the token budget prints as blanks (the default run's showcase sample wrote one line, then
# 160 spaces). The longest whitespace run in the default corpus (4 MB of the standard library)
# is 67 characters. So a sample's whitespace runs stop at MAX_WHITESPACE characters: once the
# whitespace at the end of the text reaches it, whitespace tokens are left out of the next
# draw, and the sample goes on with text. `max_whitespace=0` (`--max-whitespace 0`) lets a
# run go on; `isotrain sample` says when a run was stopped.
MAX_WHITESPACE = 64


def check_sampling(
    *,
    tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    num_samples: int = 1,
    max_whitespace: int = MAX_WHITESPACE,
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
        (max_whitespace >= 0, "--max-whitespace", max_whitespace, "use 0 (off) or more", "64"),
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
    max_whitespace: int = MAX_WHITESPACE,
) -> list[str]:
    """`num_samples` continuations of `prompt` (one batch); modes and global RNGs untouched.
    No whitespace run grows past `max_whitespace` characters (NOTE [whitespace runs])."""
    check_sampling(
        tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        num_samples=num_samples,
        max_whitespace=max_whitespace,
    )
    tok = tokenizer or ByteTokenizer()
    device = next(model.parameters()).device
    ids = tok.encode(prompt) or tok.encode("\n") or [0]
    idx = torch.tensor([ids] * num_samples, dtype=torch.long, device=device)  # (N, T)
    gen = torch.Generator(device=device).manual_seed(seed)
    forbid = None
    if max_whitespace and tok.kind != "ids":  # ids: no text, no whitespace
        forbid = whitespace_limit(
            whitespace_chars(tok, model.cfg.vocab_size, device), max_whitespace
        )
    # Every prompt length is a new shape: run compiled blocks eagerly rather than recompile.
    with eval_mode(model), torch.compiler.set_stance("force_eager"):
        out = model.generate(
            idx, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            generator=gen, forbid=forbid,
        )  # fmt: skip
    return [tok.decode(row[idx.size(1) :]) for row in out]


def whitespace_chars(tok: Tokenizer, vocab_size: int, device: torch.device) -> torch.Tensor:
    """(vocab,) the number of characters of each token that is whitespace only, else 0."""
    texts = [tok.decode([i]) if i < tok.vocab_size else "" for i in range(vocab_size)]
    chars = [len(t) if t.isspace() else 0 for t in texts]
    return torch.tensor(chars, dtype=torch.long, device=device)


def whitespace_limit(chars: torch.Tensor, limit: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """`forbid` for `GPT.generate`: whitespace tokens, in the rows whose text ends in a run of
    `limit` or more whitespace characters (`chars` from `whitespace_chars`)."""
    is_space = chars > 0

    def forbid(idx: torch.Tensor) -> torch.Tensor:
        tail = chars[idx[:, -limit:]].flip(-1)  # (B, L) from the last token back; 0: text
        run = (tail * (tail > 0).long().cumprod(-1)).sum(-1)  # (B,) whitespace at the end
        return (run >= limit)[:, None] & is_space[None, :]  # (B, vocab)

    return forbid


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
    max_whitespace: int = MAX_WHITESPACE,
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
        max_whitespace=max_whitespace,
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
