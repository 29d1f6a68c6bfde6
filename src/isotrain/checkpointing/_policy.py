"""Activation checkpointing: the seed's block, in-place policies for any model, a memory budget.

Wrapping replaces `forward` on the chosen module instances (the class, `type()`, repr and
state-dict keys stay as they were) with one that runs the original under
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`; `remove_activation_checkpointing`
undoes it. The wrapper is in `_wrap`, the budget planner in `_budget`, measurement in `_measure`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from isotrain._shared import BlockSpec, find_blocks
from isotrain.checkpointing._budget import plan_budget
from isotrain.checkpointing._selective import SELECTIVE
from isotrain.checkpointing._state import _State
from isotrain.checkpointing._wrap import (
    ModesReplayed,
    disable_caches,
    is_checkpointed,
    unwrap,
    wrap,
)

__all__ = [
    "ACPolicy",
    "CheckpointedTransformerBlock",
    "apply_activation_checkpointing",
    "checkpointed_blocks",
    "parse_policy",
    "remove_activation_checkpointing",
]

PolicyKind = Literal["none", "full", "every", "selective", "budget"]


# ---------------------------------------------------------------------------- policies
@dataclasses.dataclass(frozen=True)
class ACPolicy:
    """Which blocks to checkpoint; `str(policy)` gives back the CLI spec.

    Example:
        >>> ACPolicy("every", every=2), ACPolicy("budget", budget_bytes=200_000_000)
    """

    kind: PolicyKind = "none"
    every: int = 1  # kind "every": checkpoint blocks 0, k, 2k, ...
    budget_bytes: int = 0  # kind "budget": absolute bytes of saved activations ...
    budget_fraction: float = 0.0  # ... or a fraction of the unwrapped model's saved bytes

    def __post_init__(self) -> None:
        if self.kind not in ("none", "full", "every", "selective", "budget"):
            raise ValueError(f"unknown policy kind {self.kind!r}; {_SPEC_HELP}")
        if self.kind == "every" and self.every < 1:
            raise ValueError(f"every must be >= 1, got {self.every}; use 'every:2' for example")
        if self.kind == "budget" and (self.budget_bytes > 0) == (0 < self.budget_fraction <= 1):
            raise ValueError(
                "a budget policy needs exactly one of budget_bytes > 0 or 0 < budget_fraction "
                f"<= 1, got budget_bytes={self.budget_bytes}, fraction={self.budget_fraction}"
            )

    def __str__(self) -> str:
        if self.kind == "every":
            return f"every:{self.every}"
        if self.kind == "budget":
            if self.budget_fraction:
                return f"budget:{self.budget_fraction * 100:g}%"
            return f"budget:{self.budget_bytes}"
        return self.kind


_SPEC_HELP = (
    "expected one of 'none', 'full', 'every:K', 'selective', 'budget:BYTES' "
    "(e.g. 2e8, 200MB, 1.5GiB, 50%)"
)
_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BYTES_RE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)(e[+-]?\d+)?\s*([a-z]*|%)$")


def parse_policy(spec: str) -> ACPolicy:
    """Parse a CLI policy string: none | full | every:K | selective | budget:BYTES.

    Example:
        >>> parse_policy("every:3"), parse_policy("budget:1.5GiB"), parse_policy("budget:50%")
    """
    if not isinstance(spec, str):
        raise TypeError(f"policy spec must be a str, got {type(spec).__name__}; {_SPEC_HELP}")
    kind, sep, arg = spec.strip().lower().partition(":")
    kind, arg = kind.strip(), arg.strip()
    if kind in ("none", "full", "selective"):
        if sep:
            raise ValueError(f"policy {kind!r} takes no argument, got {spec!r}; {_SPEC_HELP}")
        return ACPolicy(kind)  # type: ignore[arg-type]
    if kind == "every":
        if not arg.isdigit() or int(arg) < 1:
            raise ValueError(
                f"bad every-k policy {spec!r}: K must be an integer >= 1, as in 'every:2'"
            )
        return ACPolicy("every", every=int(arg))
    if kind == "budget":
        return _parse_budget(spec, arg)
    raise ValueError(f"unknown checkpointing policy {spec!r}; {_SPEC_HELP}")


def _parse_budget(spec: str, arg: str) -> ACPolicy:
    m = _BYTES_RE.match(arg)
    if not m or m.group(3) not in (*_UNITS, "%"):
        raise ValueError(
            f"bad budget {spec!r}: BYTES must be a number with an optional unit "
            "(B, KB, MB, GB, KiB, MiB, GiB) or a percentage, as in 'budget:200MB' or 'budget:50%'"
        )
    value = float(m.group(1) + (m.group(2) or ""))
    if m.group(3) == "%":
        if not 0 < value <= 100:
            raise ValueError(f"bad budget {spec!r}: a percentage must be in (0, 100]")
        return ACPolicy("budget", budget_fraction=value / 100)
    n = round(value * _UNITS[m.group(3)])
    if n <= 0:
        raise ValueError(f"bad budget {spec!r}: the budget must be a positive number of bytes")
    return ACPolicy("budget", budget_bytes=n)


# ---------------------------------------------------------------------------- the seed's block
class CheckpointedTransformerBlock(nn.Module):
    """The seed's post-norm transformer block (batch-first), checkpointed by default.

    Example:
        >>> block = CheckpointedTransformerBlock(256, 4)                   # full checkpoint
        >>> plain = CheckpointedTransformerBlock(256, 4, checkpoint=False) # same math, no AC
    """

    def __init__(
        self, d_model: int, n_heads: int, *, checkpoint: bool | str = True, dropout: float = 0.0
    ) -> None:
        super().__init__()
        modes = {True: "full", False: "none", "full": "full", "none": "none"}
        mode = modes.get(checkpoint, checkpoint)
        if mode not in ("full", "none", "selective"):
            raise ValueError(
                f"checkpoint must be True, False, 'full', 'none' or 'selective', got {checkpoint!r}"
            )
        self.checkpoint_mode: str = mode
        self.attn = nn.MultiheadAttention(d_model, n_heads, dropout=dropout, batch_first=True)
        self.norm1 = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )
        self.norm2 = nn.LayerNorm(d_model)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        attn_out, _ = self.attn(x, x, x, need_weights=False)  # (B, T, D)
        x = self.norm1(x + attn_out)
        return self.norm2(x + self.ff(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_mode == "none" or _State.bypass or not torch.is_grad_enabled():
            return self._forward(x)
        fn = self._forward if torch.compiler.is_compiling() else ModesReplayed(self._forward)
        if self.checkpoint_mode == "selective":
            return checkpoint(fn, x, use_reentrant=False, context_fn=SELECTIVE)
        return checkpoint(fn, x, use_reentrant=False)


# ---------------------------------------------------------------------------- wrapping
def remove_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Undo `apply_activation_checkpointing` on every submodule; returns `model`.

    Example:
        >>> remove_activation_checkpointing(model)  # forward is the class's forward again
    """
    for mod in model.modules():
        unwrap(mod)
    return model


def checkpointed_blocks(model: nn.Module) -> list[str]:
    """Names of the modules of `model` that run under activation checkpointing, in model order
    (what `apply_activation_checkpointing` wrapped, plus checkpointing blocks of the seed's).

    Example:
        >>> apply_activation_checkpointing(model, policy="every:2")
        >>> checkpointed_blocks(model)  # ['blocks.0', 'blocks.2']
    """
    return [name for name, mod in model.named_modules() if is_checkpointed(mod)]


def apply_activation_checkpointing(
    model: nn.Module,
    *,
    policy: str | ACPolicy,
    modules: BlockSpec = None,
    example_inputs: Sequence[Any] | torch.Tensor | None = None,
    example_kwargs: dict[str, Any] | None = None,
) -> nn.Module:
    """Checkpoint the chosen blocks of `model` in place by `policy`; state-dict keys unchanged.

    `modules`: a type, tuple of types, or `(name, module) -> bool` predicate (outermost matches
    only); None means the children of each outermost `nn.ModuleList` (blocks kept in an
    `nn.Sequential`, as in ResNets, need `modules=(BasicBlock,)`). Replaces earlier wrapping
    (on error the model is left unwrapped). `budget` needs a real batch, `example_inputs`
    and/or `example_kwargs` (`model(*example_inputs, **example_kwargs)`), and raises ValueError
    when even `full` exceeds the budget. Buffers are updated once per step, as without
    checkpointing, and a model that takes `use_cache` trains with it off (one warning):
    NOTE [buffers in recompute], NOTE [caches in recompute].

    Example:
        >>> apply_activation_checkpointing(model, policy="every:2", modules=(Block,))
        >>> apply_activation_checkpointing(model, policy="budget:50%", example_inputs=(x,))
    """
    pol = policy if isinstance(policy, ACPolicy) else parse_policy(policy)
    remove_activation_checkpointing(model)
    if pol.kind == "none":
        return model
    blocks = find_blocks(model, modules, purpose=f"blocks to checkpoint with policy '{pol}'")
    if pol.kind == "budget":
        if example_inputs is None and example_kwargs is None:
            raise ValueError(
                f"policy '{pol}' needs example_inputs=(x,) and/or example_kwargs={{...}} (a real "
                "batch) to profile each block's saved bytes and FLOPs; pass them or use 'full' "
                "/ 'every:K'"
            )
        args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
        spec = (pol.budget_bytes, pol.budget_fraction)
        disable_caches(model, [name for name, _ in blocks])  # plan as training runs
        try:
            chosen = plan_budget(model, blocks, spec, tuple(args or ()), dict(example_kwargs or {}))
        except BaseException:
            remove_activation_checkpointing(model)
            raise
    elif pol.kind == "every":
        chosen = [m for i, (_, m) in enumerate(blocks) if i % pol.every == 0]
    else:
        chosen = [m for _, m in blocks]
    for mod in chosen:
        wrap(mod, selective=pol.kind == "selective")
    disable_caches(model, [name for name, m in blocks if any(m is c for c in chosen)])
    return model
