"""A decoder-only GPT: a pure nn.Module (no optimizer building, no printing, no device moves).

Pre-LayerNorm blocks, learned positions, causal attention through
`F.scaled_dot_product_attention`, GELU MLP, LM head tied to the token embedding: GPT-2. The
`GPTConfig` switches `positions`, `qk_norm`, `activation`, `tie_head` and `zero_init` give the
NanoGPT speedrun's changes (rotary positions, QK-norm, ReLU squared, untied head, zero-init
projections) one at a time (docs/benchmarks.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from isotrain.train.model.shape import GPTConfig

__all__ = ["GPT", "Block", "GPTConfig", "rotary"]

IGNORE_INDEX = -100
ROTARY_BASE = 10000.0


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotate each pair of channels (i, i + D/2) of x (B, H, T, D) by angle t * base^(-2i/D) at
    position t (RoPE): a query-key dot product then depends only on their distance."""
    T, D = x.size(-2), x.size(-1)
    freq = ROTARY_BASE ** -(
        torch.arange(0, D // 2, device=x.device, dtype=torch.float32) / (D // 2)
    )
    angle = torch.outer(torch.arange(T, device=x.device, dtype=torch.float32), freq)  # (T, D/2)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused QKV projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.rotary, self.qk_norm = cfg.positions == "rotary", cfg.qk_norm
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        if self.qk_norm:
            q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
        if self.rotary:
            q, k = rotary(q), rotary(k)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: d -> 4d -> GELU (or ReLU squared) -> d."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)
        self.approximate = "tanh" if cfg.gelu == "tanh" else "none"
        self.relu2 = cfg.activation == "relu2"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = F.relu(h).square() if self.relu2 else F.gelu(h, approximate=self.approximate)
        return self.drop(self.proj(h))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT language model. `model(idx)` gives logits; `model(idx, targets)` gives the mean loss.

    Example:
        >>> m = GPT(GPTConfig(block_size=16, n_layer=1, n_head=1, d_model=8))
        >>> m(torch.zeros(2, 16, dtype=torch.long)).shape
        torch.Size([2, 16, 256])
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model) if cfg.positions == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_head:
            self.lm_head.weight = self.wte.weight  # tied: one matrix for input and output
        self.apply(self._init_weights)
        # NOTE [residual init]: scale the projections into the residual stream by
        # 1/sqrt(2 * n_layer) so the stream's variance does not grow with depth (GPT-2);
        # zero_init starts them (and an untied head) at zero instead (the NanoGPT speedrun).
        for name, p in self.named_parameters():
            if cfg.zero_init and (name.endswith("proj.weight") or name == "lm_head.weight"):
                nn.init.zeros_(p)
            elif name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self, *, non_embedding: bool = True) -> int:
        """Parameter count; position embeddings excluded by default (as is usual)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding and self.wpe is not None else n

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab) without targets; mean cross-entropy with them.

        Targets equal to -100 are ignored, so padded positions never count.
        """
        T = idx.size(1)
        if self.cfg.block_size < T:
            raise ValueError(
                f"sequence length {T} exceeds block_size {self.cfg.block_size}; "
                "crop the input or train with a larger --model.block-size"
            )
        x = self.wte(idx)  # (B, T, C)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=idx.device))
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        if targets is None:
            return logits
        return F.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX
        )

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        forbid: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Extend `idx` (B, T) by sampling `max_new_tokens` tokens; call it in eval mode.

        temperature 0 picks the most likely token; `top_k` keeps the k most likely, `top_p`
        the smallest set whose probability reaches p (nucleus sampling); `generator` makes
        sampling reproducible without touching the global RNG; `forbid(idx)`, before each
        token, marks (B, vocab) the tokens it must not be.
        """
        if not temperature >= 0:  # also refuses NaN
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.cfg.block_size :])[:, -1, :].float()  # (B, vocab)
            if forbid is not None:
                logits = logits.masked_fill(forbid(idx), float("-inf"))
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                probs = F.softmax(_filter(logits / temperature, top_k, top_p), dim=-1)
                nxt = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def _filter(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Set to -inf every logit outside the top k and outside the top-p nucleus. (B, vocab)"""
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum - sorted_logits.softmax(dim=-1) >= top_p  # mass before it reaches p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits
