"""Attention in fp32 inside an autocast region: the mode behind ``attention="fp32"``.

Autocast runs ``F.scaled_dot_product_attention`` in its low-precision dtype like any matmul.
Where bf16 matmuls are fast but bf16 attention is not (on AMX CPUs its backward measured
slower than fp32), the best step keeps the projections in bf16 and attention in fp32.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from isotrain._shared import outside_stacklevel

__all__ = ["Fp32Attention"]

_SDPA = F.scaled_dot_product_attention  # the same object as torch._C._nn's
_MHA = F.multi_head_attention_forward

# NOTE [fp32 attention]
# A torch function mode sees every call of `F.scaled_dot_product_attention` that the model's
# own code makes (our GPT, nanoGPT, Hugging Face's sdpa attention), eager and under
# `torch.compile` (dynamo traces the mode into the graph). It cannot see calls made inside
# another overridable torch function: `nn.MultiheadAttention` goes through
# `F.multi_head_attention_forward`, and the mode sees only that outer call, so it warns once.
# The call runs with autocast off on q, k, v (and a float mask) upcast to fp32, so autograd
# records an fp32 attention and its backward runs in fp32 too; the output is cast back to q's
# dtype, so the next projection gets what it would have got. Only this op changes: Linear and
# matmul keep autocast's dtype.
# Activation checkpointing recomputes a block outside the `with`, where the mode is gone:
# isotrain's checkpointing carries the forward's function modes into the recomputation;
# `torch.utils.checkpoint` used directly does not (it refuses the fp32/bf16 mismatch loudly).


class Fp32Attention(TorchFunctionMode):
    """While entered, `F.scaled_dot_product_attention` runs on fp32 inputs with autocast off
    and returns its output in q's dtype (NOTE [fp32 attention]); every other call passes."""

    def __init__(self) -> None:
        super().__init__()
        self.warned = False

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is _MHA and not self.warned:
            self.warned = True
            warnings.warn(
                "autocast_if_available(attention='fp32'): nn.MultiheadAttention's attention "
                "runs in the autocast dtype (its functional forward hides its "
                "scaled_dot_product_attention call from the mode); call "
                "F.scaled_dot_product_attention in your attention module for fp32 attention",
                stacklevel=outside_stacklevel(),
            )
        if func is not _SDPA:
            return func(*args, **kwargs)
        q = args[0] if args else kwargs["query"]
        with torch.autocast(q.device.type, enabled=False):
            out = func(*(_fp32(a) for a in args), **{k: _fp32(v) for k, v in kwargs.items()})
        return out.to(q.dtype)


def _fp32(value: Any) -> Any:
    """A bf16 or fp16 tensor as fp32; anything else (fp32, bool masks, floats) as it is."""
    if isinstance(value, torch.Tensor) and value.dtype in (torch.bfloat16, torch.float16):
        return value.float()
    return value
