"""Activation checkpointing: the seed's block, in-place policies for any model, a memory budget.

Wrapping replaces `forward` on the chosen module instances (the class, `type()`, repr and
state-dict keys stay as they were) with one that runs the original under
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`; `remove_activation_checkpointing`
undoes it. Measurement lives in `_measure`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from isotrain._shared import BlockSpec, cuda_devices, find_blocks
from isotrain.checkpointing._measure import (
    _State,
    note_cached_outputs,
    profile_forward,
)

__all__ = [
    "ACPolicy",
    "CheckpointedTransformerBlock",
    "apply_activation_checkpointing",
    "parse_policy",
    "remove_activation_checkpointing",
    "selective_policy",
]

ContextFn = Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]
Args = tuple[Any, ...]
Kwargs = dict[str, Any]
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


# ---------------------------------------------------------------------------- selective
def _ops(*names: str) -> frozenset[Any]:
    aten = torch.ops.aten
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


_MM_OPS = _ops("mm", "addmm", "bmm", "baddbmm")
_SDPA_OPS = _ops(
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)
DEFAULT_SAVE_OPS = _MM_OPS | _SDPA_OPS


def selective_policy(
    *, save_ops: Iterable[Any] | None = None, recompute_every_other_mm: bool = True
) -> ContextFn:
    """A `context_fn` for `checkpoint` that keeps matmul/attention outputs, recomputes the rest.

    With `recompute_every_other_mm`, every second mm-like op is recomputed too (the torchtitan
    trade: in a GPT block that drops the attention out-projection and the MLP down-projection).

    Example:
        >>> checkpoint(block, x, use_reentrant=False, context_fn=selective_policy())
    """
    ops = DEFAULT_SAVE_OPS if save_ops is None else frozenset(save_ops)

    def context_fn() -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
        mm_seen = {False: 0, True: 0}  # per checkpoint call: forward and recompute count apart

        def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            if op not in ops:
                return CheckpointPolicy.PREFER_RECOMPUTE
            if recompute_every_other_mm and op in _MM_OPS:
                mm_seen[ctx.is_recompute] += 1
                if mm_seen[ctx.is_recompute] % 2 == 0:
                    return CheckpointPolicy.PREFER_RECOMPUTE
            if not ctx.is_recompute:
                note_cached_outputs(getattr(ctx, "op_output", None))
            return CheckpointPolicy.MUST_SAVE

        return create_selective_checkpoint_contexts(policy_fn)

    return context_fn


_SELECTIVE = selective_policy()


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
        if self.checkpoint_mode == "selective":
            return checkpoint(self._forward, x, use_reentrant=False, context_fn=_SELECTIVE)
        return checkpoint(self._forward, x, use_reentrant=False)


# ---------------------------------------------------------------------------- wrapping
@dataclasses.dataclass(frozen=True)
class _Wrap:
    context_fn: ContextFn
    prev_forward: Any  # an instance-level forward that was there before us, else None


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # Bound to the instance (types.MethodType), so deepcopy(model) rebinds it to the copy.
    wrap: _Wrap = self.__dict__["_isotrain_ac"]
    prev = wrap.prev_forward
    inner = prev if prev is not None else functools.partial(type(self).forward, self)
    if _State.bypass or not torch.is_grad_enabled():
        return inner(*args, **kwargs)
    context_fn = wrap.context_fn
    if context_fn is noop_context_fn:
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)
    return checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _wrap(module: nn.Module, context_fn: ContextFn = noop_context_fn) -> None:
    module.__dict__["_isotrain_ac"] = _Wrap(context_fn, module.__dict__.get("forward"))
    module.forward = types.MethodType(_checkpointed_forward, module)


def _unwrap(module: nn.Module) -> None:
    wrap = module.__dict__.pop("_isotrain_ac", None)
    if wrap is None:
        return
    if wrap.prev_forward is not None:
        module.forward = wrap.prev_forward
    else:
        del module.__dict__["forward"]


def remove_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Undo `apply_activation_checkpointing` on every submodule; returns `model`.

    Example:
        >>> remove_activation_checkpointing(model)  # forward is the class's forward again
    """
    for mod in model.modules():
        _unwrap(mod)
    return model


def apply_activation_checkpointing(
    model: nn.Module,
    *,
    policy: str | ACPolicy,
    modules: BlockSpec = None,
    example_inputs: Sequence[Any] | torch.Tensor | None = None,
) -> nn.Module:
    """Checkpoint the chosen blocks of `model` in place by `policy`; state-dict keys unchanged.

    `modules`: a type, tuple of types, or `(name, module) -> bool` predicate (outermost matches
    only); None means the children of each outermost `nn.ModuleList`. Replaces earlier wrapping
    (on error the model is left unwrapped). `budget` needs `example_inputs` and raises
    ValueError when even `full` exceeds the budget.

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
        chosen = _plan_budget(model, blocks, pol, example_inputs)
    elif pol.kind == "every":
        chosen = [m for i, (_, m) in enumerate(blocks) if i % pol.every == 0]
    else:
        chosen = [m for _, m in blocks]
    context_fn = _SELECTIVE if pol.kind == "selective" else noop_context_fn
    for mod in chosen:
        _wrap(mod, context_fn)
    return model


# ---------------------------------------------------------------------------- budget
# NOTE [budget profile]: a budget matters when the unwrapped model does not fit, so planning
# never builds the unwrapped graph: one forward with every block checkpointed gives the bytes
# outside the blocks and each block's inputs (what checkpointing it keeps); each block then
# runs alone on its captured input for its unwrapped bytes and FLOPs. Peak: full + one block.
def _profile_blocks(
    model: nn.Module, blocks: list[tuple[str, nn.Module]], inputs: Args
) -> tuple[int, list[int], list[int], list[int]]:
    """(bytes outside blocks, per-block unwrapped bytes, checkpointed bytes, forward FLOPs)."""
    captured: list[tuple[Args, Kwargs]] = []

    def capture(mod: nn.Module, args: Args, kwargs: Kwargs) -> None:
        captured.append((args, kwargs))

    handles = [m.register_forward_pre_hook(capture, with_kwargs=True) for _, m in blocks]
    for _, mod in blocks:
        _wrap(mod)
    try:
        ckpt, _ = _saved_bytes(model, blocks, inputs)
    finally:
        for (_, mod), h in zip(blocks, handles, strict=True):
            _unwrap(mod)
            h.remove()
    plain, flops = [], []
    for (name, mod), (args, kwargs) in zip(blocks, captured, strict=True):
        saved, fl = _saved_bytes(mod, [(name, mod)], args, kwargs)
        plain.append(sum(saved.values()))
        flops.append(fl.get(name, 0))
    return ckpt.get("", 0), plain, [ckpt.get(n, 0) for n, _ in blocks], flops


def _saved_bytes(
    model: nn.Module, blocks: list[tuple[str, nn.Module]], args: Args, kwargs: Kwargs | None = None
) -> tuple[dict[str, int], dict[str, int]]:
    """Per-block saved bytes ('' = outside blocks) and forward FLOPs of one forward."""
    with torch.random.fork_rng(devices=cuda_devices(args)), torch.enable_grad():
        out, saved, flops, _ = profile_forward(model, blocks, args, kwargs)
    del out  # frees the graph and everything it saved
    return saved, flops


def _plan_budget(
    model: nn.Module, blocks: list[tuple[str, nn.Module]], pol: ACPolicy, example_inputs: Any
) -> list[nn.Module]:
    """Blocks to checkpoint so saved bytes <= budget with the least recompute FLOPs."""
    if example_inputs is None:
        raise ValueError(
            f"policy '{pol}' needs example_inputs=(x,) (a real batch) to profile each block's "
            "saved bytes and FLOPs; pass them or use 'full' / 'every:K'"
        )
    inputs = (
        (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    )
    other, plain, ckpt, flops = _profile_blocks(model, blocks, inputs)
    unwrapped = other + sum(plain)
    budget = pol.budget_bytes or math.floor(pol.budget_fraction * unwrapped)
    if other + sum(ckpt) > budget:
        raise ValueError(
            f"activation budget {budget:,} B is below {other + sum(ckpt):,} B, what checkpointing "
            f"every block still saves (unwrapped: {unwrapped:,} B); raise the budget, shrink "
            "batch or sequence length, or checkpoint more module types"
        )
    gain = [p - c for p, c in zip(plain, ckpt, strict=True)]
    # Cheapest recompute per byte freed first; ties keep model order (early blocks live longest).
    order = sorted(range(len(blocks)), key=lambda i: flops[i] / max(gain[i], 1))
    chosen: list[int] = []
    for i in order:
        if unwrapped - sum(gain[j] for j in chosen) <= budget:
            break
        chosen.append(i)
    # Verify with a real measurement (cross-block sharing can shift bytes); add blocks if needed.
    for extra in [*order[len(chosen) :], None]:
        for j in chosen:
            _wrap(blocks[j][1])
        try:
            total = sum(_saved_bytes(model, blocks, inputs)[0].values())
        finally:
            for j in chosen:
                _unwrap(blocks[j][1])
        if total <= budget or extra is None:
            break
        chosen.append(extra)
    return [blocks[j][1] for j in sorted(chosen)]
