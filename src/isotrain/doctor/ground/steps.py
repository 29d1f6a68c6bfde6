"""How examine drives the user's code: their step, a plain step from their `loss_fn` (or a
Hugging Face model's own `.loss`), or their epoch function over one batch at a time; and the
torch optimizers inside what they pass (a framework's wrapper read through).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from isotrain._torch_private import optimizer_set_up
from isotrain.doctor.ground.context import StepFn
from isotrain.doctor.ground.inputs import EpochStep

__all__ = ["epoch_step", "loss_of", "optimizers_in", "plain_step"]


def plain_step(loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> StepFn:
    """isotrain's plain step: zero_grad, loss_fn, backward, optimizer.step."""

    def step(model: nn.Module, optimizer: Any, batch: Any) -> torch.Tensor:
        optimizers = optimizers_in(optimizer)
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        for opt in optimizers:
            opt.step()
        return loss

    return step


def _model_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss a Hugging Face style model returns for a dict batch: model(**batch).loss."""
    out = model(**batch)
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            "the model returned no .loss for a dict batch: put labels in the batch, or pass "
            "loss_fn=f(model, batch) or step=your_step(model, optimizer, batch)"
        )
    return loss


def loss_of(
    items: list[Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None
) -> Callable[[nn.Module, Any], torch.Tensor]:
    """loss_fn, or the model's own .loss for dict batches (refused for any other batch)."""
    if loss_fn is not None:
        return loss_fn
    if not isinstance(items[0], dict):
        raise ValueError(
            "pass step=your_step(model, optimizer, batch) or loss_fn=f(model, batch) (a dict "
            "batch needs neither when the model returns .loss)"
        )
    return _model_loss


_WRAPPED = ("optimizer", "_optimizer", "optim")  # where frameworks keep the optimizer they wrap


def _unwrapped(optimizer: Any) -> Any:
    """The torch optimizer a framework's wrapper delegates to (accelerate's
    AcceleratedOptimizer, Lightning's LightningOptimizer and the like), else `optimizer`."""
    for _ in range(8):  # wrappers of wrappers, never a cycle
        if isinstance(optimizer, torch.optim.Optimizer) and optimizer_set_up(optimizer):
            return optimizer
        held = (getattr(optimizer, name, None) for name in _WRAPPED)
        inside = next((o for o in held if isinstance(o, torch.optim.Optimizer)), None)
        if inside is None:
            return optimizer
        optimizer = inside
    return optimizer


def optimizers_in(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers in `optimizer` (one, or a sequence of them: a GAN's two), each
    taken out of a framework's wrapper; the user's step still gets what they passed."""
    many = isinstance(optimizer, (list, tuple))
    found = [_unwrapped(o) for o in (optimizer if many else [optimizer])]
    bad = [o for o in found if not isinstance(o, torch.optim.Optimizer)]
    if bad or not found:
        what = type(bad[0]).__name__ if bad else "an empty sequence"
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or a list of them, got {what}; pass "
            "the real optimizer inside a wrapper (e.g. fabric_optimizer.optimizer)"
        )
    return found


def epoch_step(epoch: Callable[[nn.Module, Any, Any], Any], source: Any) -> StepFn:
    """A step that runs the user's `epoch(model, optimizer, loader)` over one batch: their own
    model.train(), zero_grad placement and per-batch schedule, as their loop runs them."""
    return EpochStep(epoch, source)
