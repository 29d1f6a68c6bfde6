"""isotrain's guard inside Hugging Face ``Trainer``: use ``GuardedTrainer`` for ``Trainer``.

Every optimizer step becomes a ``GuardedOptimizer`` step: a NaN/Inf loss or gradient, a spike or
an fp16 overflow leaves weights, moments and the LR schedule as they were, and the skip shows in
the logs. Evaluation runs under ``eval_mode`` + ``rng_isolated``. NOTE [how GuardedTrainer
hooks in] says where and why.
"""

from __future__ import annotations

import warnings
from typing import Any, cast

import torch
from torch import nn

from isotrain.contexts import eval_mode, rng_isolated
from isotrain.doctor import Monitor
from isotrain.guard import GuardedOptimizer, SkipReason
from isotrain.integrations._extra import missing_extra
from isotrain.integrations._patterns import CheckpointingOption, CompileOption, Patterns
from isotrain.integrations._precision import Precision

try:
    from transformers import Trainer, TrainerCallback
except ImportError:  # pragma: no cover - exercised by the missing-extra test
    raise missing_extra(__name__, "transformers", "transformers") from None

__all__ = ["GuardedTrainer"]

# NOTE [how GuardedTrainer hooks in]
# Trainer creates its optimizer, hands it to accelerate (AcceleratedOptimizer: the fp16 scaler,
# gradient accumulation's sync), then builds the LR scheduler "now that the optimizer won't
# change anymore". `create_scheduler` is that moment: the AcceleratedOptimizer is wrapped there
# in a GuardedOptimizer (the guard unscales through it with accelerate's scaler, and on a skip
# does not call it, updating the scaler itself), the scheduler is built on it and wrapped
# `skip_aware` (so a skip does not advance the LR), and Trainer steps it as `self.optimizer`.
# The guard owns clipping: it clips to `args.max_grad_norm` inside its step, and Trainer's own
# clip/norm (`_clip_grad_norm`, `_get_grad_norm`) is turned off so clipping happens once; the
# logged `grad_norm` is the guard's (pre-clip, as Trainer's). The guard's state rides inside the
# optimizer's state dict, so `optimizer.pt` in every checkpoint holds it and resume restores it.
_OVERRIDDEN = (
    "create_scheduler", "training_step", "compute_loss", "_clip_grad_norm", "_get_grad_norm", "log"
)  # fmt: skip


class _LogBaseline(TrainerCallback):
    """Remember the guard's skip counts when training (re)starts: logs report skips since."""

    def __init__(self, trainer: GuardedTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._logged_skips = self.trainer._skip_counts()


class _Monitoring(TrainerCallback):
    """`monitor_every`: the Monitor's after_step() after each optimizer step; closed at the end."""

    def __init__(self, trainer: GuardedTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer.monitor is not None:
            self.trainer.monitor.after_step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer.monitor is not None:
            self.trainer.monitor.close()  # its findings stay readable


def _period(every: Any) -> int:
    if not isinstance(every, int) or isinstance(every, bool) or every < 0:
        raise ValueError(f"monitor_every must be 0 (off) or a number of steps, got {every!r}")
    return every


def _torch_optimizer(opt: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's and the guard's wrappers."""
    while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    return opt


class GuardedTrainer(Trainer):
    """``transformers.Trainer`` whose optimizer steps are guarded and whose evaluation is isolated.

    ``guard_options`` go to ``StepGuard`` (``spike_k``, ``skip_mode``, ...); ``max_norm`` is
    ``args.max_grad_norm`` (0: no clipping). Logs gain ``skipped_steps`` (skips since the last
    log) and ``skip_reason`` (their ``SkipReason`` names, ``"OK"`` for none). ``checkpointing``
    (a policy such as ``"full"``) and ``compile_blocks`` (True, or compile_model's keywords)
    are applied to the model here: NOTE [patterns in trainers]. Combine with your own
    subclass as ``class MyTrainer(GuardedTrainer, SFTTrainer)``. ``monitor_every=N`` adds an
    ``isotrain.doctor.Monitor`` checked every N optimizer steps (``trainer.monitor``; its
    findings are logged, and under torchrun the replicas are compared across ranks).
    ``precision="bf16-matmul"`` computes every loss with bf16 matmuls and attention in fp32
    (with ``args.bf16`` and ``args.fp16`` off; NOTE [bf16-matmul in trainers]).

    Example::

        trainer = GuardedTrainer(model=model, args=args, train_dataset=data)
        trainer.train()
        trainer.optimizer.guard.summary()  # {"skipped": 1, "skipped_by_reason": {...}, ...}
    """

    def __init__(
        self,
        *args: Any,
        guard_options: dict[str, Any] | None = None,
        isolate_eval: bool = True,
        checkpointing: CheckpointingOption = None,
        compile_blocks: CompileOption = False,
        monitor_every: int = 0,
        precision: str | None = None,
        **kwargs: Any,
    ) -> None:
        missing = [m for m in _OVERRIDDEN if not hasattr(Trainer, m)]
        if missing:
            raise RuntimeError(
                f"GuardedTrainer overrides Trainer.{', '.join(missing)}, which this transformers "
                "version lacks; install the version isotrain[transformers] names"
            )
        options = dict(guard_options or {})
        if "max_norm" in options or "scaler" in options:
            raise ValueError(
                "GuardedTrainer takes max_norm from args.max_grad_norm and the scaler from "
                "accelerate: leave them out of guard_options"
            )
        patterns = Patterns(checkpointing, compile_blocks, "GuardedTrainer")
        self._precision = Precision(precision, "GuardedTrainer")
        super().__init__(*args, **kwargs)
        if self._precision:
            self._apply_precision()
        if patterns:
            self._apply_patterns(patterns)
        if self.args.fp16 and not getattr(self.accelerator, "native_amp", True):
            warnings.warn(
                f"GuardedTrainer: fp16=True, but accelerate runs no fp16 autocast and no "
                f"GradScaler on {self.args.device.type}: this run trains in fp32 (bf16=True "
                "gives mixed precision there)",
                stacklevel=2,
            )
        self.guard_options, self.isolate_eval = options, isolate_eval
        self._logged_skips = [0] * len(SkipReason)
        self.add_callback(_LogBaseline(self))
        self.monitor_every, self.monitor = _period(monitor_every), cast(Monitor | None, None)
        if monitor_every:
            self.add_callback(_Monitoring(self))

    def _apply_precision(self) -> None:
        """NOTE [bf16-matmul in trainers]; refuses Trainer's own mixed precision beside it."""
        for theirs in ("bf16", "fp16"):
            if getattr(self.args, theirs, False):
                self._precision.refuse_mixed(f"args.{theirs}=True")
        if self.model_init is not None or self.model is None:
            raise ValueError(
                "GuardedTrainer(precision='bf16-matmul') needs model= (model_init builds a new "
                "model at each train())"
            )
        self._precision.prepare(self.model, self.args.device)

    def _apply_patterns(self, patterns: Patterns) -> None:
        """NOTE [patterns in trainers]; refuses what would apply a pattern twice or not at all."""
        clash = [
            f"{mine} and args.{theirs}=True both ask for it"
            for mine, theirs, given in (
                ("checkpointing", "gradient_checkpointing", patterns.checkpointing is not None),
                ("compile_blocks", "torch_compile", patterns.compile is not None),
            )
            if given and getattr(self.args, theirs, False)
        ]
        if clash or self.model_init is not None or self.model is None:
            why = "; ".join(clash) or "model_init builds a new model at each train()"
            raise ValueError(
                f"GuardedTrainer(checkpointing=, compile_blocks=): {why}. Use isotrain's "
                "options or Trainer's, not both, with model= (or apply them inside model_init)"
            )
        patterns.apply(self.model)

    def _guarded(self) -> GuardedOptimizer | None:
        opt = self.optimizer
        return opt if isinstance(opt, GuardedOptimizer) else None

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> Any:
        """Wrap the accelerate-prepared optimizer in a GuardedOptimizer; build the LR schedule."""
        again = getattr(self.optimizer, "optimizer", None)
        if isinstance(again, GuardedOptimizer):  # a second train(): accelerate wrapped ours again
            self.optimizer = again  # keep the guard (and its counters) and the wrapper inside it
        if self._guarded() is None and self.optimizer is not None:
            clip = self.args.max_grad_norm
            self.optimizer = GuardedOptimizer(
                self.optimizer,
                self.model,
                max_norm=clip if clip and clip > 0 else None,
                scaler=getattr(self.accelerator, "scaler", None),
                **self.guard_options,
            )
        guarded = self._guarded()
        sched = super().create_scheduler(num_training_steps, optimizer or guarded)
        plateau = isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau)
        if guarded is not None and not plateau and not hasattr(sched, "_guarded"):
            self.lr_scheduler = guarded.skip_aware(sched)
        if self.monitor_every and self.optimizer is not None and self.model is not None:
            opt = _torch_optimizer(self.optimizer)
            self.monitor = Monitor(self.model, opt, every=self.monitor_every)  # one per train()
        return self.lr_scheduler

    def training_step(self, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """Trainer's step; its (micro-batch) loss is what the guard checks at the next step."""
        loss = super().training_step(model, inputs, *args, **kwargs)
        guarded = self._guarded()
        if guarded is not None:
            guarded.observe_loss(loss)
        return loss

    def compute_loss(self, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """Trainer's loss, in bf16 matmuls and fp32 attention with precision="bf16-matmul"."""
        with self._precision.context(self.args.device):
            return super().compute_loss(model, inputs, *args, **kwargs)

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        return None if self._guarded() is not None else super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        return None if self._guarded() is not None else super()._get_grad_norm(model, grad_norm)

    def _skip_counts(self) -> list[int]:
        guarded = self._guarded()
        if guarded is None:
            return [0] * len(SkipReason)
        by_reason = guarded.guard.summary()["skipped_by_reason"]  # sync: at a log step
        return [0] + [by_reason[r.name] for r in SkipReason if r]

    def log(self, logs: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        """Trainer's log; a training log line gains the guard's grad norm and its skips."""
        guarded = self._guarded()
        if guarded is not None and "loss" in logs:
            counts = self._skip_counts()
            new = [n - o for n, o in zip(counts, self._logged_skips)]
            self._logged_skips = counts
            names = [SkipReason(r).name for r, n in enumerate(new) if n > 0]
            logs = {
                **logs,
                "grad_norm": guarded.guard.summary()["last_grad_norm"],
                "skipped_steps": sum(new),
                "skip_reason": ",".join(names) or SkipReason.OK.name,
            }
        super().log(logs, *args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer's evaluate, under ``eval_mode`` and ``rng_isolated`` (``isolate_eval=True``).

        Evaluating during training then leaves the training run bitwise what it would have been.
        """
        if not self.isolate_eval or self.model is None:
            return super().evaluate(*args, **kwargs)
        with eval_mode(self.model, no_grad=False), rng_isolated():
            return super().evaluate(*args, **kwargs)
