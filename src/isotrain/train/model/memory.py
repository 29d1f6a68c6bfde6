"""The least memory a training step of the GPT can take, counted before anything is built.

A lower bound, so that refusing a shape is never wrong: fp32 weights, gradients and both AdamW
moments, plus activations that the backward certainly keeps (NOTE [step memory]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from isotrain.train.model.gpt import GPT, GPTConfig

__all__ = ["StepMemory", "step_memory"]

# NOTE [step memory]
# Per block of E = batch x context x d_model values, the backward keeps at least: the two
# LayerNorm inputs (the fp32 residual stream, 2E fp32), attention's q, k, v and output (4E) and
# the MLP's hidden layer before and after GELU (8E), these 12E in the matmuls' dtype (bf16
# under autocast). Everything else a block saves (LayerNorm outputs, the projections' inputs,
# dropout masks) is left out. Under any checkpointing policy only the block inputs (E fp32 per
# block) count. The loss keeps batch x context x vocab fp32 log-probabilities. Parameters cost
# 16 bytes each (fp32 weight, gradient, two moments), shared over the ranks under FSDP.


@dataclass(frozen=True)
class StepMemory:
    """Bytes a step needs at least: model state and activations (the loss's included)."""

    state: int
    activations: int

    @property
    def total(self) -> int:
        return self.state + self.activations


def step_memory(
    cfg: GPTConfig,
    batch_size: int,
    *,
    checkpointed: bool,
    low_precision: bool,
    shards: int = 1,
) -> StepMemory:
    """The lower bound of NOTE [step memory] for `batch_size` sequences per rank; parameters
    are counted on the meta device (nothing is allocated)."""
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(cfg).parameters())
    values = batch_size * cfg.block_size * cfg.d_model  # E: one (B, T, d) activation
    if checkpointed:
        per_block = 4 * values
    else:
        per_block = 2 * 4 * values + 12 * (2 if low_precision else 4) * values
    loss = 4 * batch_size * cfg.block_size * cfg.vocab_size
    return StepMemory(16 * params // shards, cfg.n_layer * per_block + loss)
