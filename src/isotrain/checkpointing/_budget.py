"""The `budget:` policy: checkpoint the blocks that free the most bytes per recomputed FLOP."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from isotrain._shared import buffers_restored, cuda_devices
from isotrain.checkpointing._measure import profile_forward
from isotrain.checkpointing._wrap import unwrap, wrap

__all__ = ["plan_budget"]

Args = tuple[Any, ...]
Kwargs = dict[str, Any]


# NOTE [budget profile]: a budget matters when the unwrapped model does not fit, so planning
# never builds the unwrapped graph: one forward with every block checkpointed gives the bytes
# outside the blocks and each block's inputs (what checkpointing it keeps); each block then
# runs alone on its captured inputs for its unwrapped bytes and FLOPs. Peak: full + one block.
# Each block's pre-hook records its own calls, so a model that calls its blocks in another
# order than it registers them (a U-Net's middle block) still pairs every block with its
# inputs; a block called twice is profiled on both calls. The caller turns `use_cache` off
# before this runs (NOTE [caches in recompute]): blocks are profiled as training runs them.
def _profile_blocks(
    model: nn.Module, blocks: list[tuple[str, nn.Module]], inputs: Args, kwargs: Kwargs
) -> tuple[int, list[int], list[int], list[int]]:
    """(bytes outside blocks, per-block unwrapped bytes, checkpointed bytes, forward FLOPs)."""
    captured: dict[int, list[tuple[Args, Kwargs]]] = {id(m): [] for _, m in blocks}

    def capture(mod: nn.Module, args: Args, kwargs: Kwargs) -> None:
        if "use_cache" in kwargs:  # as the checkpointed forward will call it
            kwargs = {**kwargs, "use_cache": False}
        captured[id(mod)].append((args, kwargs))

    handles = [m.register_forward_pre_hook(capture, with_kwargs=True) for _, m in blocks]
    for _, mod in blocks:
        wrap(mod)
    try:
        ckpt, _ = _saved_bytes(model, blocks, inputs, kwargs)
    finally:
        for (_, mod), h in zip(blocks, handles, strict=True):
            unwrap(mod)
            h.remove()
    plain, flops = [], []
    for name, mod in blocks:
        saved_total = flop_total = 0
        for args, kw in captured[id(mod)]:
            saved, fl = _saved_bytes(mod, [(name, mod)], args, kw)
            saved_total += sum(saved.values())
            flop_total += fl.get(name, 0)
        plain.append(saved_total)
        flops.append(flop_total)
    return ckpt.get("", 0), plain, [ckpt.get(n, 0) for n, _ in blocks], flops


def _saved_bytes(
    model: nn.Module, blocks: list[tuple[str, nn.Module]], args: Args, kwargs: Kwargs | None = None
) -> tuple[dict[str, int], dict[str, int]]:
    """Per-block saved bytes ('' = outside blocks) and forward FLOPs of one forward."""
    with torch.random.fork_rng(devices=cuda_devices(args)), torch.enable_grad():
        out, saved, flops, _ = profile_forward(model, blocks, args, kwargs)
    del out  # frees the graph and everything it saved
    return saved, flops


def plan_budget(
    model: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    budget: tuple[int, float],
    inputs: Args,
    kwargs: Kwargs,
) -> list[nn.Module]:
    """Blocks to checkpoint so saved bytes <= budget (bytes, or a fraction of the unwrapped
    model's) with the least recompute FLOPs. Buffers and the RNG are left as they were."""
    with buffers_restored([model]):
        return _plan(model, blocks, budget, inputs, kwargs)


def _plan(
    model: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    budget_spec: tuple[int, float],
    inputs: Args,
    kwargs: Kwargs,
) -> list[nn.Module]:
    other, plain, ckpt, flops = _profile_blocks(model, blocks, inputs, kwargs)
    unwrapped = other + sum(plain)
    budget = budget_spec[0] or math.floor(budget_spec[1] * unwrapped)
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
            wrap(blocks[j][1])
        try:
            total = sum(_saved_bytes(model, blocks, inputs, kwargs)[0].values())
        finally:
            for j in chosen:
                unwrap(blocks[j][1])
        if total <= budget or extra is None:
            break
        chosen.append(extra)
    return [blocks[j][1] for j in sorted(chosen)]
