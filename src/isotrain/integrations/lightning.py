"""isotrain's guard inside ``lightning.Trainer``: add ``GuardCallback()`` to its callbacks.

Under automatic optimization every optimizer step becomes a ``GuardedOptimizer`` step: a NaN/Inf
loss or gradient or a spike leaves weights, moments and the LR schedule as they were, and
``skipped_steps`` / ``skip_reason`` are logged. Validation runs under ``eval_mode`` +
``rng_isolated``. NOTE [how GuardCallback hooks in] says where and why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from isotrain.contexts import eval_mode, rng_isolated
from isotrain.guard import GuardedOptimizer
from isotrain.integrations._extra import missing_extra

try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - exercised by the missing-extra test
    raise missing_extra(__name__, "lightning", "lightning") from None

__all__ = ["GuardCallback"]

# NOTE [how GuardCallback hooks in]
# `on_fit_start` runs after the strategy built the optimizers and schedulers and before a
# checkpoint is restored into them. There each torch optimizer is wrapped in a GuardedOptimizer
# (Lightning wraps that in its LightningOptimizer and calls its `step(closure)`: the closure runs
# forward and backward, its loss is what the guard checks), each LR scheduler is wrapped
# `skip_aware`, and the guard takes over `gradient_clip_val` (norm clipping) so clipping happens
# once, after the decision is known. Its state rides inside the optimizer's state dict, hence in
# every Lightning checkpoint. The validation loop's `run` is wrapped in eval_mode + rng_isolated
# (the whole run: its DataLoader iterator draws a seed from the global RNG before any hook).
# `teardown` undoes the clip take-over and the validation wrapper.


class GuardCallback(pl.Callback):
    """Guard every optimizer step of ``lightning.Trainer.fit`` (automatic optimization).

    ``max_norm`` clips by total norm (``None``: ``Trainer(gradient_clip_val=...)`` if set by
    norm, else no clipping); ``guard_options`` go to ``StepGuard`` (``spike_k``, ...).
    Logs ``skipped_steps`` (skips so far) and ``skip_reason`` (this step's ``SkipReason``).

    Example::

        trainer = lightning.Trainer(max_steps=100, callbacks=[GuardCallback()])
        trainer.fit(module, loader)
        trainer.optimizers[0].guard.summary()  # {"skipped": 1, "skipped_by_reason": {...}, ...}
    """

    def __init__(
        self, *, max_norm: float | None = None, isolate_eval: bool = True, **guard_options: Any
    ) -> None:
        if "scaler" in guard_options:
            raise ValueError("GuardCallback takes no scaler: 16-mixed precision is not supported")
        self.max_norm, self.isolate_eval, self.guard_options = max_norm, isolate_eval, guard_options
        self._undo: list[Callable[[], None]] = []
        self._steps = 0
        self._skipped: torch.Tensor | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Wrap optimizers and schedulers, take over clipping, isolate validation."""
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                "GuardCallback does not support a GradScaler (precision='16-mixed'): Lightning "
                "steps the scaler itself around the optimizer; use precision='bf16-mixed'"
            )
        if not pl_module.automatic_optimization:
            raise ValueError(
                "GuardCallback guards automatic optimization; with manual optimization wrap "
                "your optimizer in isotrain.guard.GuardedOptimizer yourself"
            )
        max_norm = self._take_clipping(trainer)
        wrapped = {
            id(o): o if isinstance(o, GuardedOptimizer) else
            GuardedOptimizer(o, pl_module, max_norm=max_norm, **self.guard_options)
            for o in trainer.strategy.optimizers
        }  # fmt: skip
        by_inner = {id(g.optimizer): g for g in wrapped.values()}
        trainer.strategy.optimizers = list(wrapped.values())
        for config in trainer.lr_scheduler_configs:
            guarded = by_inner.get(id(getattr(config.scheduler, "optimizer", None)))
            if guarded is not None and not config.reduce_on_plateau:
                config.scheduler = guarded.skip_aware(config.scheduler)
        if self.isolate_eval:
            self._isolate_validation(trainer, pl_module)

    def _take_clipping(self, trainer: pl.Trainer) -> float | None:
        clip, algorithm = trainer.gradient_clip_val, trainer.gradient_clip_algorithm
        if clip is None or algorithm != "norm":
            return self.max_norm
        if self.max_norm is not None and float(clip) != self.max_norm:
            raise ValueError(
                f"Trainer(gradient_clip_val={clip}) and GuardCallback(max_norm={self.max_norm}) "
                "disagree: set one of them (the guard clips, after its decision)"
            )
        trainer.gradient_clip_val = None

        def restore() -> None:
            trainer.gradient_clip_val = clip

        self._undo.append(restore)
        return float(clip)

    def _isolate_validation(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loop = trainer.fit_loop.epoch_loop.val_loop
        run = loop.run

        def isolated_run() -> Any:
            with eval_mode(pl_module, no_grad=False), rng_isolated():
                return run()

        def restore() -> None:
            vars(loop).pop("run", None)  # the class's own `run` shows through again

        loop.run = isolated_run  # type: ignore[method-assign]
        self._undo.append(restore)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start the logged skip count where a restored guard left it (one host read)."""
        guards = [o for o in trainer.strategy.optimizers if isinstance(o, GuardedOptimizer)]
        self._steps = sum(g.guard.steps for g in guards)
        skipped = sum(g.guard.summary()["skipped"] for g in guards)  # sync: once per fit
        self._skipped = torch.tensor(float(skipped), device=pl_module.device)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        """Log the skip count and this step's reason as device tensors (read at log steps only)."""
        guards = [o for o in trainer.strategy.optimizers if isinstance(o, GuardedOptimizer)]
        steps = sum(g.guard.steps for g in guards)
        if steps == self._steps or self._skipped is None:
            return  # an accumulation micro-batch: no optimizer step yet
        self._steps = steps
        outcomes = [g.last_outcome for g in guards if g.last_outcome is not None]
        reason = torch.stack([o.reason for o in outcomes]).max().float()
        skipped = torch.stack([(~o.applied).float() for o in outcomes]).sum()
        self._skipped = self._skipped + skipped.to(self._skipped.device)
        pl_module.log("skipped_steps", self._skipped, on_step=True, on_epoch=False)
        pl_module.log("skip_reason", reason, on_step=True, on_epoch=False)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Give clipping back to the Trainer and unwrap the validation loop."""
        with contextlib.ExitStack() as stack:
            for undo in reversed(self._undo):
                stack.callback(undo)
            self._undo.clear()
