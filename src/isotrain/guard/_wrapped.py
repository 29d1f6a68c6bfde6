"""``GuardedOptimizer``: StepGuard behind the ``torch.optim.Optimizer`` interface.

Trainers that own the loop (HF Trainer, Lightning) call ``optimizer.step()`` and nothing else;
this optimizer makes that call the guard's decision. It shares ``param_groups`` and ``state``
with the optimizer it wraps (so LR schedulers, checkpoints and frameworks see one optimizer),
and a skipped step leaves params, moments and ``step`` bitwise unchanged (StepGuard's promise).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from isotrain.guard._optim import named_trainable
from isotrain.guard._outcome import StepOutcome
from isotrain.guard._step import StepGuard

__all__ = ["GuardedOptimizer"]

_KEY = "isotrain_guard"  # the guard's counters and spike window, inside the optimizer state dict


class GuardedOptimizer(torch.optim.Optimizer):
    """A drop-in optimizer whose ``step()`` is ``StepGuard.step``: unscale, clip, decide, skip.

    ``optimizer`` may itself be a wrapper (Accelerate, Fabric); ``options`` are StepGuard's
    (``max_norm``, ``scaler``, ``spike_k``, ...). The loss the guard checks is the closure's
    result, else the sum of what ``observe_loss`` got since the last step (else 0: no loss check).

    Example::

        opt = GuardedOptimizer(torch.optim.AdamW(model.parameters()), model, max_norm=1.0)
        sched = opt.skip_aware(torch.optim.lr_scheduler.StepLR(opt, 10))  # holds on a skip
        loss = model(x).mean(); loss.backward(); opt.observe_loss(loss)
        opt.step(); sched.step()  # a NaN gradient: skipped, and the LR stays
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module | Iterable[torch.Tensor] | None = None,
        **options: Any,
    ) -> None:
        # Optimizer.__init__ is not called: it would build param groups of its own.
        self.optimizer = optimizer
        self._model = model if isinstance(model, nn.Module) or model is None else list(model)
        self.guard = StepGuard(optimizer, self._model, **options)
        self.last_outcome: StepOutcome | None = None
        self._loss: torch.Tensor | None = None
        self._zero_grad_profile_name = f"Optimizer.zero_grad#{type(self).__name__}.zero_grad"
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()

    # -- what it shares with the optimizer it wraps ----------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"GuardedOptimizer({self.optimizer!r})"

    # -- the step ---------------------------------------------------------------------------
    def observe_loss(self, loss: torch.Tensor | float) -> None:
        """Add a (micro-batch) loss to what the next ``step()`` checks; no sync."""
        value = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        self._loss = value if self._loss is None else self._loss + value

    @torch.optim.Optimizer.profile_hook_step
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run ``closure`` (under grad) if given, then the guarded step; returns its result.

        An optimizer that needs a closure (LBFGS) runs it as often as it likes, each
        evaluation checked, and a skip puts parameters and state back: NOTE [closure steps].
        """
        if self.guard.needs_closure:
            if closure is None:
                raise TypeError(
                    f"GuardedOptimizer: {type(self.guard.inner).__name__}.step() needs a closure"
                    " that zeroes the grads, computes the loss, calls backward and returns it"
                )
            self._loss = None
            result, self.last_outcome = self.guard.step_with_closure(closure)
            return result
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
            if isinstance(result, torch.Tensor):
                self.observe_loss(result)
        loss, self._loss = self._loss, None
        self.last_outcome = self.guard.step(loss if loss is not None else 0.0)
        return result

    @property
    def applied(self) -> bool:
        """Whether the last step was applied (True before any step; syncs on an accelerator)."""
        outcome = self.last_outcome
        return outcome is None or bool(outcome.applied)  # sync: read once per step, on a skip

    def skip_aware(self, scheduler: Any) -> Any:
        """``scheduler``, seen through a view whose ``step()`` does nothing after a skipped step.

        Everything else (``state_dict``, ``get_last_lr``, attributes) is the scheduler's own, so
        checkpoints hold the plain scheduler state. A skip then delays the schedule by one step.
        """
        return _SkipAwareScheduler(scheduler, self)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``; the guard zeroes the same way after its steps
        (NOTE [the user's zero_grad])."""
        self.guard.set_to_none = set_to_none
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add the group to the wrapped optimizer; the guard then checks and clips it too."""
        self.optimizer.add_param_group(param_group)
        guard = self.guard
        guard.names, guard.params = named_trainable(
            self._model if isinstance(self._model, nn.Module) else None, guard.inner
        )

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict plus the guard's state under ``"isotrain_guard"``.

        A plain optimizer loads it (torch ignores the extra key); loading a plain optimizer's
        state dict here keeps the guard's state as it is.
        """
        for pre in self._optimizer_state_dict_pre_hooks.values():
            pre(self)
        out = {**self.optimizer.state_dict(), _KEY: self.guard.state_dict()}
        for post in self._optimizer_state_dict_post_hooks.values():
            out = post(self, out) or out
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped optimizer's part, and the guard's when present."""
        for pre in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = pre(self, state_dict) or state_dict
        rest = dict(state_dict)
        guard_state = rest.pop(_KEY, None)
        self.optimizer.load_state_dict(rest)
        if guard_state is not None:
            self.guard.load_state_dict(guard_state)
        for post in self._optimizer_load_state_dict_post_hooks.values():
            post(self)


class _SkipAwareScheduler:
    """An LR scheduler whose ``step()`` is a no-op after a skipped optimizer step."""

    def __init__(self, scheduler: Any, optimizer: GuardedOptimizer) -> None:
        self.__dict__["_scheduler"] = scheduler
        self.__dict__["_guarded"] = optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self._guarded.applied:
            self._scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return dict(self._scheduler.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_scheduler"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._scheduler, name, value)

    def __repr__(self) -> str:
        return f"skip_aware({self._scheduler!r})"
