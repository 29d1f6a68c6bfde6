"""The GPT's shape, `GPTConfig` (the `--model.*` flags), apart from the model itself.

It imports no torch: the `isotrain` command parses and checks its flags, and answers
`--help`, before torch is imported (tests/train/test_cli.py holds it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["GPTConfig"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the GPT (the trainer's `--model.*` flags). Changing any field but dropout
    makes a snapshot incompatible."""

    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide d_model."""
    d_model: int = 128
    """Width of the residual stream."""
    block_size: int = 128
    """Context length in tokens (bytes for the default tokenizer)."""
    vocab_size: int = 256
    """Vocabulary size; left at 256 it takes the run's tokenizer's (a tokenizer.json, prepared
    data, --init-from); the number of tokens to train for --tokenizer bpe."""
    dropout: float = 0.0
    """Dropout probability in attention and MLP outputs."""
    bias: bool = True
    """Use biases in Linear and LayerNorm layers."""
    gelu: Literal["exact", "tanh"] = "exact"
    """GELU form in the MLP: exact (erf), or tanh (GPT-2's approximation, for its checkpoints)."""
    activation: Literal["gelu", "relu2"] = "gelu"
    """MLP nonlinearity: gelu (GPT-2), or relu2, ReLU squared (the NanoGPT speedrun's)."""
    positions: Literal["learned", "rotary"] = "learned"
    """learned: a position embedding added to the input (GPT-2); rotary: queries and keys
    rotated by their position in each attention layer (RoPE), no position parameters."""
    qk_norm: bool = False
    """RMS-normalise each head's queries and keys before attention (bounds the logits)."""
    tie_head: bool = True
    """The LM head is the token embedding (GPT-2); False gives the head its own matrix."""
    zero_init: bool = False
    """Start the projections into the residual stream (and an untied head) at zero, so each
    block begins as the identity."""
