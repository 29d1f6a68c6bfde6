"""Which line of the user's step writes a parameter outside optimizer.step(): the judged call
run again under a dispatch mode that sees every in-place aten op and the tensors it writes."""

from __future__ import annotations

from typing import Any

import torch

from isotrain.doctor.ground.context import Context
from isotrain.doctor.ground.dispatch import WatchMode
from isotrain.doctor.ground.watch import user_site

__all__ = ["writers"]


class _Writes(WatchMode):
    """The first user line that writes each watched parameter's storage, optimizer.step()
    (and its hooks) aside."""

    def __init__(self, storages: dict[int, int]) -> None:
        super().__init__()
        self.storages = storages  # storage data_ptr -> id(param)
        self.stepping = 0
        self.lines: dict[int, str] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self.stepping and func._schema.is_mutable:
            self._note(func, args, kwargs)
        return func(*args, **kwargs)

    def _note(self, func: Any, args: Any, kwargs: Any) -> None:
        for n, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[n] if n < len(args) else kwargs.get(arg.name)
            for t in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    pid = self.storages.get(t.untyped_storage().data_ptr())
                    if pid is not None:
                        self.lines.setdefault(pid, user_site().where)


def writers(ctx: Context, calls: int, params: list[torch.Tensor]) -> dict[int, str]:
    """`{id(param): the first line that wrote it outside a step()}` over the first `calls`
    calls of the user's step from examine's state (the doctor's own ops make no writes)."""
    model, opt = ctx.fresh()
    mode = _Writes({p.untyped_storage().data_ptr(): id(p) for p in params})

    def pre(*_: Any) -> None:
        mode.stepping += 1

    def post(*_: Any) -> None:
        mode.stepping -= 1

    handles = [o.register_step_pre_hook(pre) for o in ctx.optimizers]
    handles += [o.register_step_post_hook(post) for o in ctx.optimizers]
    try:
        with mode:
            for call in range(calls):
                ctx.run_step(model, opt, ctx.batches[call % len(ctx.batches)])
    except Exception:  # the call ran before: a failure here only leaves lines unknown
        pass
    finally:
        for h in handles:
            h.remove()
    return mode.lines
