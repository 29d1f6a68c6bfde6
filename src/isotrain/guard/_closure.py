"""Closure optimizers (torch.optim.LBFGS): every evaluation checked, a skipped step undone.

``LBFGS.step(closure)`` evaluates the loss and gradient several times (its iterations and
line search), moving the parameters in between: NOTE [closure steps].
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from isotrain.guard._optim import optimizer_params
from isotrain.guard._outcome import HostOutcome, StepOutcome, _host_reason
from isotrain.guard._spikes import HostSpikeDetector

__all__ = ["closure_step", "needs_closure"]

# `guard` below is the StepGuard (typed Any: _step imports this module, not the reverse).
#
# NOTE [closure steps]
# An optimizer whose step() cannot run without a closure evaluates it several times per step
# and reads each loss as a Python float itself, so its guarded step decides on the host, in
# any skip mode. Before the step the guard copies the parameters and the optimizer's whole
# state (LBFGS keeps its direction history and counters in Python lists); the step then runs
# with a closure that, after each evaluation, measures the gradient norm, clips to max_norm
# (as clip_grad_norm_ inside the closure would: LBFGS reads the clipped gradient) and records
# loss and norm. The step is skipped when any evaluation had a non-finite loss or gradient, or
# when the first one (the loss at the step's starting point, what other optimizers' steps
# check) spikes: parameters and state are put back bit for bit, buffers too where protected.
# A closure that raises puts them back as well, and the error propagates.


def needs_closure(optimizer: Any) -> bool:
    """Whether `optimizer.step` cannot run without a closure (torch.optim.LBFGS)."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def _evaluations(guard: Any, closure: Callable[[], Any]) -> tuple[Any, list[Any]]:
    """Step the optimizer with a closure that clips and records (loss, norm) per evaluation."""
    seen: list[tuple[float, float]] = []

    def checked() -> Any:
        with torch.enable_grad():
            loss = closure()
        grads, norm = guard._grad_norm()
        if guard.max_norm is not None and grads:
            nn.utils.clip_grads_with_norm_(guard.params, guard.max_norm, norm)
        value = loss.detach() if isinstance(loss, torch.Tensor) else loss
        seen.append((float(value), norm.item()))  # sync: the optimizer reads the loss too
        return loss

    return guard.optimizer.step(checked), seen


def _decide(guard: Any, seen: list[tuple[float, float]]) -> tuple[int, float, float]:
    """(reason, loss, norm) of a closure step: any non-finite evaluation skips it."""
    lf, nf = seen[0] if seen else (0.0, 0.0)
    if not all(math.isfinite(v) for v, _ in seen):
        lf = math.nan
    if not all(math.isfinite(v) for _, v in seen):
        nf = math.nan
    if guard._world() > 1:  # agree across ranks: NaN anywhere is NaN everywhere
        vec = torch.tensor([lf, nf], dtype=torch.float32, device=guard.device)
        lf, nf = guard._all_reduce_mean(vec).tolist()  # sync: host decision
    spikes = guard.spikes
    assert spikes is None or isinstance(spikes, HostSpikeDetector)  # closure steps: host mode
    return _host_reason(lf, 0.0, nf, spikes), lf, nf


def closure_step(guard: Any, closure: Callable[[], Any]) -> tuple[Any, StepOutcome]:
    """The guarded step of a closure optimizer: NOTE [closure steps]. Returns the step's
    result (LBFGS: the first evaluation's loss) and the outcome."""
    inner = guard.inner
    params = optimizer_params(inner)
    with torch.no_grad():
        saved = [p.detach().clone() for p in params]
    state = {p: copy.deepcopy(s) for p, s in inner.state.items()}  # keys: the params themselves
    reason = -1  # not decided: an error in the closure or the step puts everything back
    try:
        result, seen = _evaluations(guard, closure)
        reason, lf, nf = _decide(guard, seen)
    finally:
        ok = reason == 0
        if not ok:
            with torch.no_grad():
                for p, old in zip(params, saved):
                    p.copy_(old)
            inner.state.clear()
            inner.state.update(state)
        if guard.buffers is not None:
            guard.buffers.settle(ok, host=True)
    guard._count_host(reason, nf, lf, 1.0)
    guard.zero_grad()
    applied_t, reason_t = guard._consts
    norm_t = torch.tensor(nf, dtype=torch.float32, device=guard.device)
    return result, HostOutcome(applied_t[reason], reason_t[reason], norm_t, lf, guard._one)
