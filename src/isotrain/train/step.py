"""One training step, read top to bottom: batch, forward, backward, guarded update, recovery.

`train_step` needs a `Run`, not `setup`: build one from your own model, optimizer and
`Updater` to reuse the step in your loop. The step makes no host-device sync: loss, gradient
norm and skip decision stay on the device until a log step reads them.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from isotrain.contexts import eval_mode, rng_isolated
from isotrain.train.parallel import all_reduce_mean, no_grad_sync
from isotrain.train.precision import autocast_for
from isotrain.train.state import Run
from isotrain.train.update.optim import lr_at, set_lr

__all__ = ["evaluate", "forward", "precision_context", "train_step"]


def precision_context(
    precision: str, device: torch.device
) -> contextlib.AbstractContextManager[Any]:
    """The autocast context of `precision` ("fp32": none; "bf16-matmul": bf16 with attention
    in fp32) for forward passes on `device`."""
    return autocast_for(precision, device)


def forward(run: Run, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean loss of one micro-batch, under the run's precision."""
    with precision_context(run.cfg.precision, run.dist.device):
        return run.train_model(x, y)


def _micro_step(run: Run, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Forward and backward of one micro-batch; returns its loss as the updater used it."""
    loss = forward(run, x, y)
    if run.cfg.grad_accum > 1:  # one micro-batch: no extra op on the step's fixed cost
        loss = loss / run.cfg.grad_accum
    return run.updater.backward(loss, run.state.step)


def train_step(run: Run) -> Any:
    """One optimizer step over `grad_accum` micro-batches; returns the device-side outcome."""
    cfg, st = run.cfg, run.state
    loss_sum: torch.Tensor | None = None
    for micro in range(cfg.grad_accum):
        x, y, n = run.batches.get("train", st.step, micro)
        if micro == cfg.grad_accum - 1:  # the last (or only) one reduces gradients across ranks
            used = _micro_step(run, x, y)
        else:
            with no_grad_sync(run.train_model, sync=False):
                used = _micro_step(run, x, y)
        loss_sum = used if loss_sum is None else loss_sum.detach() + used.detach()
        st.tokens_seen += n * run.dist.world_size
    set_lr(run.optimizer, lr_at(st.step, cfg.optim, cfg.steps) * run.updater.lr_factor(st.step))
    assert loss_sum is not None  # grad_accum >= 1 (validated)
    outcome = run.updater.step(loss_sum, st.step)
    run.updater.recover(st.step)  # roll back after too many skips (its own cadence)
    st.step += 1
    return outcome


def evaluate(run: Run) -> float:
    """Mean validation loss over the evaluation windows (the whole split where it fits in
    --eval-batches), each batch weighted by its windows, averaged over ranks."""
    total = torch.zeros((), device=run.dist.device)
    model: nn.Module = run.train_model
    batches = run.batches.val(run.cfg.eval_batches)
    with eval_mode(model), rng_isolated():
        for x, y in batches:
            total += forward(run, x, y).float() * len(x)
    windows = sum(len(x) for x, _ in batches)
    return float(all_reduce_mean(total / windows))  # sync: evaluation result
