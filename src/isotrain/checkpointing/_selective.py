"""Selective activation checkpointing: keep matmul and attention outputs, recompute the rest."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from isotrain.checkpointing._state import note_cached_outputs

__all__ = ["DEFAULT_SAVE_OPS", "SELECTIVE", "ContextFn", "selective_policy"]

ContextFn = Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]


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


SELECTIVE = selective_policy()  # the 'selective' policy's context_fn
