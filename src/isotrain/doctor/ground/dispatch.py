"""The base of the doctor's dispatch modes: they see every aten op and run custom ops as torch does.

A dispatch mode's handler runs with autocast turned off, so a `torch.library.custom_op` whose
body multiplies a 16-bit activation by a float32 weight would fail there, and one on float32
inputs would compute in float32, though the same call casts them in the user's own run:
NOTE [custom ops under autocast].
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from isotrain._torch_private import DispatchMode

__all__ = ["WatchMode"]

_DEVICES = ("cpu", "cuda")
_ATEN = ("aten", "prim", "prims")

# NOTE [custom ops under autocast]
# The autocast state at a custom op's call is read where it is still visible: a torch function
# mode, entered with each WatchMode, records it at every torch call (a custom op is one), and
# the handler of a non-aten op runs under an autocast region with that state, so the op's body
# dispatches its own ops through autocast as it does without the doctor. Aten ops passed
# autocast before reaching the mode and need nothing.
_seen = threading.local()


class _AutocastAtCall(TorchFunctionMode):
    """Records, at every torch call, the devices autocast is on for and their dtypes."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        _seen.state = {
            d: torch.get_autocast_dtype(d) for d in _DEVICES if torch.is_autocast_enabled(d)
        }
        return func(*args, **(kwargs or {}))


class WatchMode(DispatchMode):
    """A dispatch mode whose subclasses' handlers run a custom op under the autocast state its
    caller had (NOTE [custom ops under autocast]); aten ops are handed over as they come."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        handler = cls.__dict__.get("__torch_dispatch__")
        if handler is None:
            return

        def dispatch(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            state = getattr(_seen, "state", None)
            if not state or getattr(func, "namespace", "aten") in _ATEN:
                return handler(self, func, types, args, kwargs)
            with contextlib.ExitStack() as regions:
                for device, dtype in state.items():
                    regions.enter_context(torch.autocast(device, dtype=dtype))
                return handler(self, func, types, args, kwargs)

        cls.__torch_dispatch__ = dispatch  # type: ignore[method-assign]

    def __enter__(self) -> Any:
        self._calls = _AutocastAtCall()
        self._calls.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._calls.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            self._calls.__exit__(*exc)
            _seen.state = None
