"""What every check works with: the user's setup, deep copies of it, and the model's inputs.

Checks that step work on `copies()` (model and optimizer copied together, so the copy's
optimizer holds the copy's parameters) from the RNG state the user had, so nothing of the
user's changes; checks that only read do so under a restoring context.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from isotrain._shared import capture_rng, restore_rng
from isotrain._torch_private import tree_leaves

__all__ = ["CannotRun", "Context", "Probe", "StepFn", "as_loss", "first_tensor", "params_of"]

StepFn = Callable[[nn.Module, torch.optim.Optimizer, Any], Any]
_LABELS = ("labels", "label", "targets", "target", "y")


@dataclass
class Probe:
    """One watched step from the user's state on a copy (shared by several checks)."""

    loss: float | None
    got_grad: set[str]  # names of parameters a gradient reached
    changed: set[str]  # names of parameters the step changed
    watch: Any  # the OpWatch of the step
    error: str | None = None
    step_leaks: list[str] = field(default_factory=list)  # StateAudit differences, buffers aside


class CannotRun(Exception):
    """A check that cannot run on this setup: examine turns it into an info finding."""


@dataclass
class Context:
    """The user's setup and the helpers the checks share."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: Sequence[Any]
    step: StepFn
    eval_fn: Callable[[nn.Module, Any], Any] | None
    task: str | None
    uses_default_step: bool
    rng: dict[str, Any] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)
    ranks: Any = None  # the doctor's link between ranks (a _ranks.Ranks) under a process group

    def copies(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Deep copies of the model and optimizer, the copy's optimizer on the copy's params,
        with the user's RNG state put back (so a step on the copy draws what theirs would)."""
        try:
            model, opt = copy.deepcopy((self.model, self.optimizer))
        except Exception as e:
            raise RuntimeError(
                f"cannot deep-copy the model and optimizer ({type(e).__name__}: {e}); the "
                "doctor steps copies so yours stay untouched"
            ) from e
        restore_rng(self.rng)
        return model, opt

    def refuse(self, reason: str | None) -> None:
        """CannotRun(reason) when this rank has a reason not to run, and on every rank when any
        rank has one: under a process group the ranks then take the same collectives."""
        if self.ranks is not None:
            reasons = self.ranks.gather("whether a check can run", reason)
            reason = next((f"on rank {r}: {why}" for r, why in enumerate(reasons) if why), None)
            reason = reasons[self.ranks.rank] or reason
        if reason:
            raise CannotRun(reason)

    def run_step(self, model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> Any:
        """The user's step on (a copy of) the model."""
        return self.step(model, opt, batch)

    def rng_now(self) -> dict[str, Any]:
        return capture_rng()

    # -- the model's inputs and outputs ------------------------------------------------------
    def split(self, batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The model's inputs in `batch`: a tensor, the first item of a tuple, or a dict's
        entries except the labels."""
        if isinstance(batch, torch.Tensor):
            return (batch,), {}
        if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
            return (batch[0],), {}
        if isinstance(batch, dict):
            return (), {k: v for k, v in batch.items() if k not in _LABELS}
        raise ValueError(
            f"cannot find the model's inputs in a batch of type {type(batch).__name__}: the "
            "doctor feeds a tensor, the first tensor of a tuple, or a dict's non-label entries"
        )

    def main_input(self, batch: Any) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
        """The batch's main input tensor and a function that rebuilds the batch around another."""
        args, kwargs = self.split(batch)
        if args:
            return args[0], lambda t: ((t,), kwargs)
        key = "input_ids" if "input_ids" in kwargs else None
        if key is None:
            key = next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)
        if key is None:
            raise ValueError("the batch dict holds no tensor to feed the model")
        return kwargs[key], lambda t: ((), {**kwargs, key: t})

    def outputs(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The model's main output tensor (logits): `.logits`, or its first floating tensor."""
        out = model(*args, **kwargs)
        logits = getattr(out, "logits", None)
        if isinstance(logits, torch.Tensor):
            return logits
        t = first_tensor(out)
        if t is None:
            raise ValueError(f"the model returned no floating tensor ({type(out).__name__})")
        return t


def first_tensor(out: Any) -> torch.Tensor | None:
    """The first floating-point tensor in a (nested) output."""
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t
    return None


def params_of(model: nn.Module) -> dict[str, nn.Parameter]:
    """Named parameters, each tensor once (tied weights under their first name)."""
    return dict(model.named_parameters())


def as_loss(value: Any) -> torch.Tensor | None:
    """The step's returned loss as a tensor (a float, a tensor, or a tuple starting with one)."""
    if isinstance(value, (tuple, list)) and value:
        value = value[0]
    if isinstance(value, (int, float)):
        return torch.tensor(float(value))
    return value if isinstance(value, torch.Tensor) else None
