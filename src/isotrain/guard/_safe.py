"""The seed's simple guarded step: it branches on the host, so it syncs twice per call."""

from __future__ import annotations

import logging

import torch
from torch import nn

from isotrain.guard._optim import optimizer_params

__all__ = ["safe_backward"]

log = logging.getLogger(__name__)


def safe_backward(
    loss: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None = None,
    *,
    max_norm: float = 1.0,
) -> bool:
    """Backward, clip, step and zero grads, unless the loss or the gradient norm is non-finite.

    Returns whether the step was applied. It syncs twice per call (it branches on the host); in
    training loops use :class:`StepGuard`, which decides on the device.

    Example::

        applied = safe_backward(loss_fn(model(x), y), optimizer, max_norm=1.0)
    """
    scaling = scaler is not None and scaler.is_enabled()
    if not bool(torch.isfinite(loss.detach()).all()):  # sync: the seed's API branches on the host
        log.warning("non-finite loss: skipping the step")
        optimizer.zero_grad(set_to_none=True)
        return False
    (scaler.scale(loss) if scaling else loss).backward()  # type: ignore[union-attr]
    if scaling:
        scaler.unscale_(optimizer)  # type: ignore[union-attr]
    norm = nn.utils.clip_grad_norm_(optimizer_params(optimizer), max_norm)
    if not bool(torch.isfinite(norm)):  # sync: as above
        log.warning("non-finite gradient norm: skipping the step")
        optimizer.zero_grad(set_to_none=True)
        if scaling:
            scaler.update()  # type: ignore[union-attr]  # lowers the scale on overflow
        return False
    if scaling:
        scaler.step(optimizer)  # type: ignore[union-attr]
        scaler.update()  # type: ignore[union-attr]
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return True
