"""Test aids for code that must not sync the host: use them in your own tests too.

Not part of the training API: nothing in isotrain imports this module at run time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["forbid_host_sync"]


@contextlib.contextmanager
def forbid_host_sync() -> Iterator[None]:
    """Make Python-level host reads of any tensor raise while active (a test aid).

    Patches ``Tensor.item/tolist/numpy/cpu/__bool__/__float__/__int__/__index__``. On CUDA also
    use ``torch.cuda.set_sync_debug_mode("error")``, which sees syncs made inside C++.

    Example: ``with forbid_host_sync(): guard.step(loss)  # raises if the guard reads a tensor``
    """
    names = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")
    saved = {n: torch.Tensor.__dict__.get(n) for n in names}

    def trap(name: str) -> Callable[..., Any]:
        def raiser(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"host sync: Tensor.{name}() called inside a sync-free region")

        return raiser

    try:
        for n in names:
            setattr(torch.Tensor, n, trap(n))
        yield
    finally:
        for n, fn in saved.items():
            if fn is None:
                delattr(torch.Tensor, n)
            else:
                setattr(torch.Tensor, n, fn)
