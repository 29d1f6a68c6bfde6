"""Subnormal floats flushed to zero on the CPU for a block, and the flag put back after it.

NOTE [subnormals]: as a model trains in fp32, values below 1.2e-38 (float32's smallest normal)
appear in its activations and gradients, and an x86 core runs every arithmetic operation on
them through a slow microcode path: the fp32 step of a 6-layer d 384 GPT went from 320 to over
600 ms between steps 50 and 100 (benchmarks/results/avx512-bf16/mfu-subnormals.md). Flushing
them to zero (FTZ/DAZ, `torch.set_flush_denormal`) removes the cost and changes only values
below that bound. The flag lives in each thread's floating-point control register: setting it
reaches the calling thread and the threads it starts afterwards, so torch's CPU worker threads
get it only if the block is entered before torch's first parallel CPU operation starts them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["flush_subnormals", "subnormals_flushed"]


def subnormals_flushed() -> bool:
    """Whether this thread flushes float32 subnormals to zero (read by computing one).

    Example: ``torch.set_flush_denormal(True); assert subnormals_flushed()``
    """
    # float32 on the CPU whatever the default dtype or device (a meta or CUDA default included)
    smallest_normal = torch.tensor(
        torch.finfo(torch.float32).tiny, dtype=torch.float32, device="cpu"
    )
    return bool((smallest_normal / 2).item() == 0.0)


@contextlib.contextmanager
def flush_subnormals(enabled: bool = True) -> Iterator[bool]:
    """Flush CPU subnormal floats to zero inside the block (NOTE [subnormals]), then restore
    the flag as it was; yields whether subnormals are flushed (False where the CPU cannot).

    Example::

        with flush_subnormals() as flushed:   # first thing in the program: workers inherit it
            train(model)
    """
    before = subnormals_flushed()
    supported = torch.set_flush_denormal(enabled)
    try:
        yield enabled and supported
    finally:
        torch.set_flush_denormal(before)
