"""isotrain's guard inside ``lightning.Trainer``: add ``GuardCallback()`` to its callbacks.

Under automatic optimization every optimizer step becomes a ``GuardedOptimizer`` step: a NaN/Inf
loss or gradient or a spike leaves weights, moments and the LR schedule as they were, and
``skipped_steps`` / ``skip_reason`` are logged. Validation runs under ``eval_mode`` +
``rng_isolated``. With ``precision="16-mixed"`` the guard drives the Trainer's GradScaler.
NOTE [how GuardCallback hooks in] and NOTE [the guard owns the scaler] say where and why.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, cast

import torch

from isotrain._torch_private import scaler_pending
from isotrain.contexts import eval_mode, rng_isolated
from isotrain.doctor import Monitor
from isotrain.guard import GuardedOptimizer
from isotrain.integrations._extra import missing_extra
from isotrain.integrations._patterns import CheckpointingOption, CompileOption, Patterns
from isotrain.integrations._precision import Precision

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


# NOTE [skips reach the loggers]
# Lightning sends step metrics to its loggers only at its log steps (`log_every_n_steps`);
# what `log()` got at the steps between is overwritten before it is sent. So the reasons of
# the skips since the last logged step are kept and logged at the next one (as GuardedTrainer
# does for HF's logging_steps), and `log()` is called only there: it is costly per call. Skips
# after the last logged step of a fit are written to the loggers at `on_train_end`.


# NOTE [the guard owns the scaler]
# With precision='16-mixed' Lightning scales the loss, unscales, calls `scaler.step(optimizer)`
# (which skips the step itself on an overflow, unseen by the guard) and `scaler.update()`. The
# callback puts a view of the scaler in the precision plugin: `unscale_` unscales the torch
# optimizer inside the GuardedOptimizer (so the guard finds the gradients unscaled, and
# `on_before_optimizer_step` hooks see true values, as without the guard); `step` always calls
# the GuardedOptimizer, which decides (an overflow is a SCALER_OVERFLOW skip it counts), clips,
# steps or skips and updates the scale once; `update` then has nothing left to do. Everything
# else (scale, state_dict for checkpoints) is the real scaler's.


class _GuardOwnsScaler:
    """The Trainer's GradScaler as the guard drives it (NOTE [the guard owns the scaler])."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler

    def unscale_(self, optimizer: Any) -> None:
        inner = optimizer.optimizer if isinstance(optimizer, GuardedOptimizer) else optimizer
        self.scaler.unscale_(inner)

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(optimizer, GuardedOptimizer):
            return self.scaler.step(optimizer, *args, **kwargs)
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if scaler_pending(self.scaler):  # the guard updates it in its step; never twice
            self.scaler.update(new_scale)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scaler, name)


def _guards(trainer: pl.Trainer) -> list[GuardedOptimizer]:
    return [o for o in trainer.strategy.optimizers if isinstance(o, GuardedOptimizer)]


class GuardCallback(pl.Callback):
    """Guard every optimizer step of ``lightning.Trainer.fit`` (automatic optimization).

    ``max_norm`` clips by total norm (``None``: ``Trainer(gradient_clip_val=...)`` if set by
    norm, else no clipping); ``guard_options`` go to ``StepGuard`` (``spike_k``, ...).
    Logs ``skipped_steps`` (skips so far) and ``skip_reason`` (the highest ``SkipReason`` code
    among the skips since the last logged step, 0 for none) at Lightning's log steps.
    ``checkpointing`` (a policy such as ``"full"``) and ``compile_blocks`` (True, or
    compile_model's keywords) are applied to the module at fit start: NOTE [patterns in
    trainers]. ``monitor_every=N`` adds an ``isotrain.doctor.Monitor`` of the first optimizer,
    checked every N optimizer steps (``callback.monitor``; its findings are logged; under DDP
    the replicas are compared). ``precision="bf16-matmul"`` runs the training and validation
    steps with bf16 matmuls and attention in fp32 (Trainer at its default precision "32-true";
    NOTE [bf16-matmul in trainers]).

    Example::

        trainer = lightning.Trainer(max_steps=100, callbacks=[GuardCallback()])
        trainer.fit(module, loader)
        trainer.optimizers[0].guard.summary()  # {"skipped": 1, "skipped_by_reason": {...}, ...}
    """

    def __init__(
        self,
        *,
        max_norm: float | None = None,
        isolate_eval: bool = True,
        checkpointing: CheckpointingOption = None,
        compile_blocks: CompileOption = False,
        monitor_every: int = 0,
        precision: str | None = None,
        **guard_options: Any,
    ) -> None:
        self._patterns = Patterns(checkpointing, compile_blocks, "GuardCallback")
        self._precision = Precision(precision, "GuardCallback")
        if (
            not isinstance(monitor_every, int)
            or isinstance(monitor_every, bool)
            or monitor_every < 0
        ):
            raise ValueError(
                f"monitor_every must be 0 (off) or a number of steps, got {monitor_every!r}"
            )
        self.monitor_every, self.monitor = monitor_every, cast(Monitor | None, None)
        if "scaler" in guard_options:
            raise ValueError(
                "GuardCallback takes no scaler: with precision='16-mixed' it uses the Trainer's"
            )
        self.max_norm, self.isolate_eval, self.guard_options = max_norm, isolate_eval, guard_options
        self._undo: list[Callable[[], None]] = []
        self._steps = self._skipped = 0
        self._pending: list[int] = []  # reasons of the skips not logged yet

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Checkpoint and compile blocks if asked; wrap optimizers and schedulers, take over
        clipping, isolate validation."""
        if not pl_module.automatic_optimization:
            raise ValueError(
                "GuardCallback guards automatic optimization; with manual optimization wrap "
                "your optimizer in isotrain.guard.GuardedOptimizer yourself"
            )
        self._take_precision(trainer, pl_module)  # NOTE [bf16-matmul in trainers]
        self._patterns.apply(pl_module)  # NOTE [patterns in trainers]
        max_norm = self._take_clipping(trainer)
        scaler = self._take_scaler(trainer)
        options = {**self.guard_options, **({"scaler": scaler} if scaler is not None else {})}
        wrapped = {
            id(o): o if isinstance(o, GuardedOptimizer) else
            GuardedOptimizer(o, pl_module, max_norm=max_norm, **options)
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
        if self.monitor_every and trainer.strategy.optimizers:
            first = trainer.strategy.optimizers[0]
            inner = first.optimizer if isinstance(first, GuardedOptimizer) else first
            monitor = self.monitor = Monitor(pl_module, inner, every=self.monitor_every)
            self._undo.append(monitor.close)  # its findings stay readable

    def _take_precision(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """With precision="bf16-matmul", run the training and validation steps in it."""
        if not self._precision:
            return
        if str(trainer.precision) not in ("32-true", "32"):
            self._precision.refuse_mixed(f"Trainer(precision={trainer.precision!r})")
        self._precision.prepare(pl_module, pl_module.device)
        plugin: Any = trainer.precision_plugin
        for name in ("train_step_context", "val_step_context"):
            theirs = getattr(plugin, name)

            @contextlib.contextmanager
            def step_context(theirs: Callable[[], Any] = theirs) -> Any:
                with theirs(), self._precision.context(pl_module.device):
                    yield

            setattr(plugin, name, step_context)
            self._undo.append(functools.partial(vars(plugin).pop, name, None))

    def _take_clipping(self, trainer: pl.Trainer) -> float | None:
        clip, algorithm = trainer.gradient_clip_val, trainer.gradient_clip_algorithm
        by_norm = str(getattr(algorithm, "value", algorithm) or "norm") == "norm"  # its default
        if clip is None or not by_norm:
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

    def _take_scaler(self, trainer: pl.Trainer) -> torch.amp.GradScaler | None:
        """With precision='16-mixed', hand the Trainer's GradScaler to the guard (NOTE [the
        guard owns the scaler]); returns it, or None without one."""
        plugin: Any = trainer.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        if scaler is None:
            return None
        plugin.scaler = _GuardOwnsScaler(scaler)

        def restore() -> None:
            plugin.scaler = scaler

        self._undo.append(restore)
        return scaler

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        """With a GradScaler the guard's step gets no closure: give it each micro-batch's loss."""
        if isinstance(getattr(trainer.precision_plugin, "scaler", None), _GuardOwnsScaler):
            for guarded in _guards(trainer):
                guarded.observe_loss(loss)

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
        guards = _guards(trainer)
        self._steps = sum(g.guard.steps for g in guards)
        self._skipped = sum(g.guard.summary()["skipped"] for g in guards)  # sync: once per fit

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        """Log the skip count and the reasons of the skips since the last logged step, at
        Lightning's log steps (NOTE [skips reach the loggers])."""
        guards = _guards(trainer)
        steps = sum(g.guard.steps for g in guards)
        if steps == self._steps:
            return  # an accumulation micro-batch: no optimizer step yet
        self._steps = steps
        if self.monitor is not None:
            self.monitor.after_step()
        # sync: one host read per step on an accelerator, the one the skip-aware LR makes
        skipped = [g for g in guards if not g.applied]
        self._skipped += len(skipped)
        self._pending += [int(g.last_outcome.reason) for g in skipped if g.last_outcome]
        connector = getattr(trainer, "_logger_connector", None)
        if connector is None or connector.should_update_logs or getattr(trainer, "fast_dev_run", 0):
            pl_module.log("skipped_steps", float(self._skipped), on_step=True, on_epoch=False)
            pl_module.log("skip_reason", float(max(self._pending, default=0)), on_step=True,
                          on_epoch=False)  # fmt: skip
            self._pending.clear()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Skips after the last logged step go to the loggers directly (log() is closed here)."""
        if self._pending:
            metrics = {"skipped_steps": float(self._skipped),
                       "skip_reason": float(max(self._pending))}  # fmt: skip
            for logger in trainer.loggers:  # at the last step's index, as Lightning counts
                logger.log_metrics(metrics, step=max(trainer.global_step - 1, 0))
            self._pending.clear()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Give clipping back to the Trainer and unwrap the validation loop."""
        with contextlib.ExitStack() as stack:
            for undo in reversed(self._undo):
                stack.callback(undo)
            self._undo.clear()
