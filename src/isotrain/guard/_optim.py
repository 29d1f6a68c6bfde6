"""The torch optimizer inside a wrapper, and a found_inf flag that reaches its fused kernel.

Loops we did not write hand the guard a wrapper: Lightning Fabric's ``_FabricOptimizer``,
HF Accelerate's ``AcceleratedOptimizer``, or a user's own forwarding class. The guard keeps
stepping the wrapper (its bookkeeping runs), but decides and skips on the torch optimizer
inside it: NOTE [wrapped optimizers].
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["found_inf_on", "named_trainable", "optimizer_chain", "optimizer_params"]

# NOTE [wrapped optimizers]
# A wrapper's `step` calls the real optimizer's `step` sooner or later, but an attribute set
# on the wrapper does not reach it: Fabric's wrapper keeps its own __dict__, so a `found_inf`
# set there was never read by the fused kernel, which applied the NaN update while the guard
# reported a skip. So the guard finds the chain wrapper -> ... -> torch optimizer: at each
# level, the single torch.optim.Optimizer held in an attribute, taken only when it holds the
# very same parameters (a sharding wrapper such as ZeroRedundancyOptimizer holds a shard:
# it is not unwrapped). Then:
# - "found_inf": a step pre-hook on the innermost optimizer sets `found_inf` on that object,
#   right before its kernel runs, whatever the wrappers do on the way (a GradScaler's own
#   flag is kept: the two are combined with max); a post-hook puts back what was there.
# - "select": params and the state of every optimizer in the chain are copied and selected.
# - "host": the step is not called at all on a skip: safe for anything with a `step`.
# An object that is not a torch optimizer and holds none gets "host", with one warning.


def optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    """Every parameter in `optimizer.param_groups`, in group order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def named_trainable(
    model: nn.Module | Iterable[torch.Tensor] | None, optimizer: torch.optim.Optimizer
) -> tuple[list[str], list[torch.Tensor]]:
    """Names and parameters the guard watches: the model's trainable ones, else the optimizer's."""
    named: list[tuple[str, torch.Tensor]]
    if isinstance(model, nn.Module):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    else:
        params = list(model) if model is not None else optimizer_params(optimizer)
        named = [(f"param{i}", p) for i, p in enumerate(params)]
    if not named:
        raise ValueError("StepGuard found no parameters: pass the model or a non-empty list")
    return [n for n, _ in named], [p for _, p in named]


def _held_optimizers(obj: Any) -> list[torch.optim.Optimizer]:
    """The distinct torch optimizers stored in `obj`'s attributes (Fabric, Accelerate, users')."""
    found: dict[int, torch.optim.Optimizer] = {}
    for value in getattr(obj, "__dict__", {}).values():
        if isinstance(value, torch.optim.Optimizer) and value is not obj:
            found[id(value)] = value
    return list(found.values())


def optimizer_chain(optimizer: Any) -> list[Any]:
    """``[optimizer, ..., innermost]``: wrappers down to the torch optimizer doing the work."""
    chain = [optimizer]
    while True:
        held = _held_optimizers(chain[-1])
        if len(held) != 1 or any(held[0] is c for c in chain):
            return chain
        try:
            outer = {id(p) for p in optimizer_params(chain[-1])}
        except (AttributeError, KeyError, TypeError):
            outer = None  # a wrapper that does not forward param_groups: trust the one it holds
        if outer is not None and outer != {id(p) for p in optimizer_params(held[0])}:
            return chain  # it holds other parameters (a shard): not a transparent wrapper
        chain.append(held[0])


@contextlib.contextmanager
def found_inf_on(optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> Iterator[None]:
    """While active, each `optimizer.step()` sees `found_inf = flag` (max with one already set).

    Hooks, not an attribute set now: a wrapper between the caller and `optimizer` may set and
    delete its own flag (GradScaler.step does) right before the kernel runs.
    """
    missing = object()
    saved: list[tuple[Any, Any]] = []

    def put_back(opt: Any, theirs: Any, scale: Any) -> None:
        for name, value in (("found_inf", theirs), ("grad_scale", scale)):
            if value is missing:
                opt.__dict__.pop(name, None)
            else:
                setattr(opt, name, value)

    def pre(opt: Any, args: Any, kwargs: Any) -> None:
        d = opt.__dict__
        theirs, scale = d.get("found_inf", missing), d.get("grad_scale", missing)
        saved.append((theirs, scale))
        if theirs is missing or theirs is None:
            opt.found_inf = flag
        else:
            opt.found_inf = torch.maximum(theirs, flag.to(theirs.device))
        if scale is missing:
            opt.grad_scale = None

    def post(opt: Any, args: Any, kwargs: Any) -> None:
        put_back(opt, *saved.pop())

    handles = [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        while saved:  # the kernel raised between the hooks: undo what `pre` set
            put_back(optimizer, *saved.pop())
