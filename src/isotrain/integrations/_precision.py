"""`precision="bf16-matmul"` for a trainer we do not own: bf16 matmuls, attention in fp32.

``GuardedTrainer`` and ``GuardCallback`` take it as the isotrain trainer's ``--precision
bf16-matmul``: NOTE [bf16-matmul in trainers].
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from isotrain.autograd import bf16_linear_layers
from isotrain.contexts import autocast_if_available

__all__ = ["PRECISIONS", "Precision"]

PRECISIONS = (None, "bf16-matmul")

# NOTE [bf16-matmul in trainers]
# The forward (and the loss) runs under bf16 autocast with every
# F.scaled_dot_product_attention on fp32 inputs (autocast_if_available(attention="fp32")), so
# the matmuls of the projections and the MLP run in bf16 and attention in fp32; weights,
# gradients and optimizer state stay fp32. On an AVX2 CPU (isotrain.autograd.native_bf16_matmul
# False, or ISOTRAIN_CPU_KIND=avx2) the model's nn.Linear layers become Bf16Linear in place,
# as the isotrain trainer does, so their bf16 products take the fast operand layouts. The
# framework's own mixed precision (Trainer's bf16/fp16, Lightning's "bf16-mixed") is refused
# beside it: two autocasts would leave unclear which one decides attention.


class Precision:
    """The precision option of a trainer integration, validated: None (the framework's own) or
    "bf16-matmul". Example: ``Precision("bf16-matmul", "GuardCallback").context("cpu")``"""

    def __init__(self, precision: str | None, where: str) -> None:
        if precision not in PRECISIONS:
            raise ValueError(
                f"{where}(precision={precision!r}): use None (the trainer's own precision) or "
                "'bf16-matmul' (bf16 matmuls, attention in fp32)"
            )
        self.precision, self.where = precision, where

    def __bool__(self) -> bool:
        return self.precision is not None

    def refuse_mixed(self, theirs: str) -> None:
        """Refuse the framework's own mixed precision `theirs` beside bf16-matmul."""
        if self.precision is not None:
            raise ValueError(
                f"{self.where}(precision='bf16-matmul') runs its own bf16 autocast, and {theirs} "
                "asks for another: pass one of them (NOTE [bf16-matmul in trainers])"
            )

    def prepare(self, model: nn.Module, device: torch.device | str) -> None:
        """Bf16Linear layers where the CPU's bf16 matmuls need their layouts (AVX2)."""
        if self.precision is not None and torch.device(device).type == "cpu":
            bf16_linear_layers(model)

    def context(self, device: torch.device | str) -> contextlib.AbstractContextManager[Any]:
        """Where the forward runs: bf16 autocast with attention in fp32 (or nothing)."""
        if self.precision is None:
            return contextlib.nullcontext()
        return autocast_if_available(torch.bfloat16, device=device, attention="fp32")
