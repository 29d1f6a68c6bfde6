"""The precisions a run trains in, and the autocast context of each.

Every mode keeps fp32 weights, gradients and optimizer state; they differ in the forward:
`bf16` and `fp16` autocast every matmul and attention, `bf16-matmul` autocasts the matmuls and
runs attention in fp32 (`autocast_if_available(attention="fp32")`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal

import torch

from isotrain.contexts import autocast_if_available

__all__ = ["AUTOCAST", "MODES", "autocast_for"]

MODES = ("fp32", "bf16", "bf16-matmul")  # what `auto` times and chooses between

# The autocast of each low precision: its dtype, and where attention runs.
AUTOCAST: dict[str, tuple[torch.dtype, Literal["autocast", "fp32"]]] = {
    "bf16": (torch.bfloat16, "autocast"),
    "bf16-matmul": (torch.bfloat16, "fp32"),
    "fp16": (torch.float16, "autocast"),
}


def autocast_for(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The autocast context of `precision` on `device` ("fp32": none)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision not in AUTOCAST:
        raise ValueError(
            f"precision {precision!r} has no autocast context: resolve 'auto' first "
            f"(setup does), or pass one of 'fp32', {', '.join(map(repr, AUTOCAST))}"
        )
    dtype, attention = AUTOCAST[precision]
    return autocast_if_available(dtype, device=device, attention=attention)
