"""What every check works with: the user's setup, put back as it was, and the model's inputs.

Checks run on the user's own objects through `fresh()`, which first puts back the state they
had when `examine` was called (a `Snapshot`, NOTE [restore, don't copy]) and the RNG state;
examine puts it back again after every check. `copies()` is for structural trials only.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from isotrain._shared import restore_rng
from isotrain._torch_private import ddp_reduction_pending, ddp_reset_reduction, tree_leaves
from isotrain.doctor.ground.globals import StepState
from isotrain.doctor.ground.snapshot import Snapshot

__all__ = [
    "BATCH_NORMS", "STAT_NORMS", "CannotRun", "Context", "Probe", "StepFn",
    "as_loss", "first_tensor", "inner", "params_of",
]  # fmt: skip

StepFn = Callable[[nn.Module, Any, Any], Any]  # (model, optimizer(s), batch) -> loss
_LABELS = ("labels", "label", "targets", "target", "y")
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
# norms that subtract each channel's own mean: a per-channel bias before them cancels out
STAT_NORMS = (*BATCH_NORMS, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


@dataclass
class Probe:
    """One watched step from the user's state (shared by several checks)."""

    loss: float | None
    got_grad: set[str]  # names of parameters a gradient reached
    changed: set[str]  # names of parameters the step changed
    watch: Any  # the OpWatch of the step
    error: str | None = None
    step_leaks: list[str] = field(default_factory=list)  # StateAudit differences, buffers aside
    zero_grad: set[str] = field(default_factory=set)  # every gradient exactly zero in backward
    lost_grad: set[str] = field(default_factory=set)  # nonzero in backward, gone at the update
    finite: bool = True  # the loss and every gradient at the update were finite


class CannotRun(Exception):
    """A check that cannot run on this setup: examine turns it into an info finding."""


@dataclass
class Context:
    """The user's setup and the helpers the checks share."""

    model: nn.Module
    optimizer: Any  # what the step is given: one optimizer, or the user's sequence of them
    optimizers: list[torch.optim.Optimizer]
    batches: Sequence[Any]
    step: StepFn
    eval_fn: Callable[[nn.Module, Any], Any] | None
    task: str | None
    uses_default_step: bool
    rng: dict[str, Any] = field(default_factory=dict)
    samples_interact: bool = False  # the user's declaration: dim 0 is not independent samples
    loss_falls: bool | None = None  # the user's declaration: None = judge by the setup
    asked: frozenset[str] = frozenset()  # kinds the user named in checks=[...]
    cache: dict[str, Any] = field(default_factory=dict)
    source: Any = None  # the `batches` object as given (a DataLoader, for its workers)
    ranks: Any = None  # the doctor's link between ranks (a ranks.link.Ranks) under a process group
    snapshot: Snapshot = field(init=False)
    step_state: StepState = field(init=False)
    settled: bool = field(init=False)  # DDP's reducer waited for nothing when examine began

    def __post_init__(self) -> None:
        self.snapshot = Snapshot(self.model, self.optimizers)
        self.step_state = StepState(self.step, self.eval_fn)
        self.settled = not (_is_ddp(self.model) and ddp_reduction_pending(self.model))

    def reset(self) -> None:
        """Put the user's objects, the state their step keeps in globals, global flags and
        RNG back as examine found them (DDP's reducer too: a step whose reduction never
        finished leaves it waiting)."""
        self.snapshot.restore()
        self.step_state.restore()
        restore_rng(self.rng)
        if self.settled and _is_ddp(self.model) and ddp_reduction_pending(self.model):
            ddp_reset_reduction(self.model)

    def fresh(self) -> tuple[nn.Module, Any]:
        """The user's own model and optimizer(s), as they were when examine was called, with
        the user's RNG state (so a step draws what theirs would)."""
        self.reset()
        return self.model, self.optimizer

    def copies(self) -> nn.Module:
        """A deep copy of the model as examine found it, for trials that change its structure;
        CannotRun when it cannot be copied."""
        self.reset()
        try:
            model = copy.deepcopy(self.model)
        except Exception as e:
            raise CannotRun(
                f"the model cannot be deep-copied ({type(e).__name__}: {str(e)[:80]}), and "
                "this check changes a copy's structure"
            ) from e
        restore_rng(self.rng)
        return model

    def refuse(self, reason: str | None) -> None:
        """CannotRun(reason) when this rank has a reason not to run, and on every rank when any
        rank has one: under a process group the ranks then take the same collectives."""
        if self.ranks is not None:
            reasons = self.ranks.gather("whether a check can run", reason)
            reason = next((f"on rank {r}: {why}" for r, why in enumerate(reasons) if why), None)
            reason = reasons[self.ranks.rank] or reason
        if reason:
            raise CannotRun(reason)

    def run_step(self, model: nn.Module, opt: Any, batch: Any) -> Any:
        """The user's step."""
        return self.step(model, opt, batch)

    # -- the model's inputs and outputs ------------------------------------------------------
    def split(self, batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The model's inputs in `batch`: a tensor, the first item of a tuple, or a dict's
        entries (labels too when the forward takes them: an encoder-decoder builds its
        decoder's inputs from them)."""
        if isinstance(batch, torch.Tensor):
            return (batch,), {}
        if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
            return (batch[0],), {}
        if isinstance(batch, dict):
            takes = _takes(inner(self.model))
            return (), {k: v for k, v in batch.items() if k not in _LABELS or takes(k)}
        raise ValueError(
            f"cannot find the model's inputs in a batch of type {type(batch).__name__}: the "
            "doctor feeds a tensor, the first tensor of a tuple, or a dict's non-label entries"
        )

    def forward_once(self, model: nn.Module, handles: list[Any]) -> None:
        """One no-grad forward of the first batch (hooks watching it), then `handles` removed."""
        args, kwargs = self.split(self.batches[0])
        try:
            with torch.no_grad():
                model(*args, **kwargs)
        finally:
            for h in handles:
                h.remove()

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


def _takes(model: nn.Module) -> Callable[[str], bool]:
    """Whether the model's forward accepts a keyword of that name."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return lambda name: False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return lambda name: True
    return lambda name: name in params


def inner(model: nn.Module) -> nn.Module:
    """The module a DDP / DataParallel / torch.compile wrapper runs (the model itself else)."""
    while True:
        nxt = getattr(model, "module", None) if _is_wrapper(model) else None
        nxt = nxt if nxt is not None else getattr(model, "_orig_mod", None)
        if not isinstance(nxt, nn.Module):
            return model
        model = nxt


def _is_ddp(model: nn.Module) -> bool:
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


def _is_wrapper(model: nn.Module) -> bool:
    parallel = torch.nn.parallel
    return isinstance(model, (parallel.DistributedDataParallel, parallel.DataParallel))


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
