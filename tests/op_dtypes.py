"""`OpDtypes`: which aten ops ran, how often, on which floating-point dtypes; `SdpaDtypes`: the
dtypes scaled_dot_product_attention was called with (precision tests)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from isotrain._torch_private import DispatchMode, tree_leaves


class OpDtypes(DispatchMode):
    """(op, dtypes of its floating-point tensor inputs) of every aten or custom op run inside;
    a custom op counts as one op (what runs inside it is its own business)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, set[torch.dtype]] = {}
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        leaves = tree_leaves((args, kwargs or {}))
        floats = {t.dtype for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()}
        name = func.__name__.split(".")[0]
        self.ops.setdefault(name, set()).update(floats)
        self.calls[name] += 1
        return func(*args, **(kwargs or {}))

    def where(self, match: Callable[[str], bool]) -> set[torch.dtype]:
        """The dtypes every op whose name `match`es ran on; fails when none ran."""
        found = [d for op, d in self.ops.items() if match(op)]
        assert found, "no such op ran"
        return set().union(*found)


class SdpaDtypes(TorchFunctionMode):
    """The dtypes of q, k and v at every F.scaled_dot_product_attention call, as the kernel
    gets them: ATen's CPU math path upcasts bf16 itself, so its ops cannot tell."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is F.scaled_dot_product_attention:
            self.dtypes.update(t.dtype for t in args[:3])
            self.calls += 1
        return func(*args, **(kwargs or {}))
