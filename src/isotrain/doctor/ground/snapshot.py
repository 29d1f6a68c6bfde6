"""A snapshot of the caller's own training objects, restored in place after every check.

The doctor runs the user's step on the user's real model and optimizers (so DDP's hooks,
`.grad`s, Parameter attributes, LBFGS internals and a step that closes over the real objects
all stay what they are) and puts back what a check changed: NOTE [restore, don't copy].
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from isotrain.contexts import StateAudit

__all__ = ["Snapshot", "bound_schedulers"]

# NOTE [restore, don't copy]
# A deep copy loses `.grad`, attributes set on Parameters (tensor-parallel flags), LBFGS's
# `_params`, and DDP's reducer (a copy builds a new one, hiding hooks left on old parameters);
# a legacy spectral_norm model cannot be copied at all after a training forward; and a step
# that calls a scheduler or model it closes over changes the real objects anyway. So checks
# work on the real objects, and this snapshot puts back, in place and with identity kept:
# every parameter and its `.grad`, every buffer, every training / requires_grad flag and the
# global flags (a `StateAudit` with check_params), what the model's modules hold as attributes
# (a call counter, an output kept as `self.last_out`: rebound, and one the step added removed;
# DDP's, FSDP's and dynamo's wrappers keep their own bookkeeping), each optimizer's state and
# param_groups, and the LR schedulers bound to them.
# Also torch.distributions' default for validate_args: dynamo's first compile in a process turns
# it off for good, so a compile check would otherwise silence the argument checks (and their
# host syncs) of every step the user runs after it.
_WRAPPERS = ("torch.nn.parallel", "torch.distributed", "torch._dynamo")  # their own bookkeeping
_GONE = object()


def bound_schedulers(optimizers: Sequence[torch.optim.Optimizer]) -> list[Any]:
    """The LR schedulers alive in this process whose `.optimizer` is one of `optimizers`
    (two scans of the garbage collector's objects: about 0.1 s each in a large process)."""
    wanted = {id(o) for o in optimizers}
    kinds = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    refs = gc.get_referrers(*optimizers)
    dicts = [r for r in refs if isinstance(r, dict)]  # instance __dict__s holding an optimizer
    owners = [r for r in refs if isinstance(r, kinds)]
    owners += [o for o in gc.get_referrers(*dicts) if isinstance(o, kinds)] if dicts else []
    found = {id(s): s for s in owners if id(getattr(s, "optimizer", None)) in wanted}
    return list(found.values())


class _OptimizerState:
    """One optimizer's state and param_groups (parameters kept as themselves)."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt
        self.memo = {id(p): p for g in opt.param_groups for p in g["params"]}
        self.groups = [(g, self._copy({k: v for k, v in g.items() if k != "params"}))
                       for g in opt.param_groups]  # fmt: skip
        self.state = {p: (s, self._copy(dict(s))) for p, s in opt.state.items()}

    def _copy(self, value: Any) -> Any:
        with torch.no_grad():
            return copy.deepcopy(value, dict(self.memo))

    def restore(self) -> None:
        opt = self.opt
        opt.param_groups[:] = [g for g, _ in self.groups]
        for group, saved in self.groups:
            params = group["params"]
            group.clear()
            group.update(self._copy(saved), params=params)
        for p in [p for p in opt.state if p not in self.state]:
            del opt.state[p]
        for p, (s, saved) in self.state.items():
            now, values = opt.state.get(p), self._copy(saved)
            for key, value in values.items():
                old = s.get(key)
                if _same_kind(old, value):
                    with torch.no_grad():
                        old.copy_(value)
                    values[key] = old  # the same tensor object, its value back
            s.clear()
            s.update(values)
            if now is not s:
                opt.state[p] = s


def _same_kind(a: Any, b: Any) -> bool:
    return (
        isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
    )  # fmt: skip


class Snapshot:
    """What `restore()` puts back: the model (values, grads, flags, buffers), the global
    flags, the optimizers and their schedulers (found when not given), as they were when
    this was taken."""

    def __init__(
        self,
        model: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        schedulers: Sequence[Any] | None = None,
    ) -> None:
        self.audit = StateAudit(model, check_rng=False, warn=False, check_params=True)
        with self.audit:
            pass  # records everything StateAudit covers; restore() puts it back
        self.attrs = [
            (m, dict(vars(m)))
            for m in model.modules()
            if not type(m).__module__.startswith(_WRAPPERS)
        ]
        self.optimizers = [_OptimizerState(o) for o in optimizers]
        if schedulers is None:
            schedulers = bound_schedulers(optimizers)
        self.schedulers = [(s, copy.deepcopy(s.state_dict())) for s in schedulers]
        self.validate_args = torch.distributions.Distribution._validate_args

    @property
    def scheduler_objects(self) -> list[Any]:
        """The schedulers this snapshot covers."""
        return [s for s, _ in self.schedulers]

    def restore(self) -> None:
        """Put everything back, in place (the same Parameter, buffer and state objects)."""
        self.audit.restore()
        for m, held in self.attrs:
            now = vars(m)
            for k in [k for k in now if k not in held]:
                del now[k]  # set by the step since: `self.last_out = out`
            for k, v in held.items():
                if now.get(k, _GONE) is not v:
                    now[k] = v
        for o in self.optimizers:
            o.restore()
        for s, saved in self.schedulers:
            s.load_state_dict(copy.deepcopy(saved))
        torch.distributions.Distribution.set_default_validate_args(self.validate_args)
