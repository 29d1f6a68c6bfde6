"""What every check works with: the user's setup, put back as it was, and the model's inputs.

Checks run on the user's own objects through `fresh()`, which first puts back the state they
had when `examine` was called (a `Snapshot`, NOTE [restore, don't copy]) and the RNG state;
examine puts it back again after every check. `copies()` is for structural trials only.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from isotrain._shared import buffers_restored, capture_rng, restore_rng
from isotrain._torch_private import ddp_reduction_pending, ddp_reset_reduction, tree_leaves
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.globals import MAX_DEPTH, MAX_OBJECTS, StepState
from isotrain.doctor.ground.inputs import EpochStep, Loader, ModelCall, Stop
from isotrain.doctor.ground.snapshot import Snapshot

__all__ = [
    "BATCH_NORMS", "STAT_NORMS", "CannotRun", "Context", "Probe", "StepFn",
    "as_loss", "first_tensor", "inner", "params_of",
]  # fmt: skip

StepFn = Callable[[nn.Module, Any, Any], Any]  # (model, optimizer(s), batch) -> loss
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
    cache: dict[Any, Any] = field(default_factory=dict)
    source: Any = None  # the `batches` object as given (a DataLoader, for its workers)
    ranks: Any = None  # the doctor's link between ranks (a ranks.link.Ranks) under a process group
    forward: Callable[[nn.Module, Any], Any] | None = None  # the user's: how to call the model
    total_steps: int | None = None  # the user's declaration: optimizer steps in the whole run
    checkpoint: tuple[Any, Any] | None = None  # the user's (save(path), load(path)) pair
    snapshot: Snapshot = field(init=False)
    step_state: StepState = field(init=False)
    settled: bool = field(init=False)  # DDP's reducer waited for nothing when examine began

    def __post_init__(self) -> None:
        self.snapshot = Snapshot(self.model, self.optimizers)
        handed = self.optimizer if isinstance(self.optimizer, (list, tuple)) else [self.optimizer]
        self.step_state = StepState(
            self.step, self.eval_fn, skip=[*self.model.modules(), *self.optimizers], objects=handed
        )
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

    def unrestored(self) -> list[Finding]:
        """An info finding naming the state the user's step reads that lies past what examine
        puts back (NOTE [reachable state] in ground.globals), none when it all comes back."""
        kept = self.step_state
        if not kept.missed:
            return []
        more = (
            f" (+{kept.missed - len(kept.left_out)} more)"
            if kept.missed > len(kept.left_out)
            else ""
        )
        return [Finding(
            "global_state_leak", "info", "your step's state",
            f"not put back after examine: {', '.join(kept.left_out)}{more}, past {MAX_DEPTH} "
            f"levels or {MAX_OBJECTS} objects of what your step reads by name; their contents "
            "are as the last check left them",
            "rebuild these objects after examine, or keep what the step reads by name small "
            "(data in a DataLoader, not in an object the step reads)",
        )]  # fmt: skip

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

    def run_eval(self, model: nn.Module) -> Any:
        """The user's eval_fn on the examined batches, handed over as their own loader (its
        dataset, sampler, batch_size); its failure here is CannotRun, with its first line."""
        if self.eval_fn is None:
            raise CannotRun("no eval_fn given: pass eval_fn=your_validation(model, batches)")
        try:
            return self.eval_fn(model, Loader(list(self.batches), self.source))
        except Exception as e:
            first = (str(e).splitlines() or [""])[0][:120]
            raise CannotRun(
                f"your eval_fn raised {type(e).__name__} ({first}) on the examined batches"
            ) from e

    def run_step(self, model: nn.Module, opt: Any, batch: Any) -> Any:
        """The user's step; an LBFGS step with one closure iteration (NOTE [one iteration])."""
        with _one_iteration(self.optimizers):
            return self.step(model, opt, batch)

    @property
    def per_epoch(self) -> bool:
        """The step is the user's epoch function (examine's epoch=), run over one batch a call."""
        return isinstance(self.step, EpochStep)

    def run_epoch(self, model: nn.Module, opt: Any, batches: Sequence[Any]) -> Any:
        """One call of the user's epoch function over `batches` (under epoch= only), as
        run_step runs a step; what happens once a batch then happens len(batches) times."""
        if not isinstance(self.step, EpochStep):
            raise TypeError("run_epoch needs examine's epoch= driver")
        with _one_iteration(self.optimizers):
            return self.step.over(model, opt, list(batches))

    # -- how the model is called: NOTE [the user's call] in ground.inputs -------------------
    def call(self, batch: Any) -> ModelCall:
        """How the user's code calls the model for `batch` (recorded once per batch); CannotRun
        saying what to pass where their step never calls the model itself."""
        key = ("model call", id(batch))
        if key not in self.cache:
            self.cache[key] = self._recorded(batch)
        found = self.cache[key]
        if isinstance(found, str):
            raise CannotRun(found)
        return found

    def _recorded(self, batch: Any) -> ModelCall | str:
        """The user's `forward`, or the arguments their step passes the model (the step stopped
        at that call and put back), or why there are none."""
        if self.forward is not None:
            return ModelCall((batch,), {}, self.forward)
        model, opt = self.fresh()
        seen: list[ModelCall] = []

        def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            seen.append(ModelCall(tuple(args), dict(kwargs)))
            raise Stop

        # first of all pre-hooks: an FSDP2 unshard never starts for a call that does not run
        handle = model.register_forward_pre_hook(record, with_kwargs=True, prepend=True)
        try:
            with torch.compiler.set_stance("force_eager"):
                self.run_step(model, opt, batch)
        except Stop:
            pass
        except Exception as e:
            first = (str(e).splitlines() or [""])[0][:120]
            return (
                f"your step raised {type(e).__name__} before it called the model ({first}); "
                "pass forward=(model, batch) -> output to say how to call it"
            )
        finally:
            handle.remove()
            self.reset()
        if not seen:
            return (
                "your step does not call the model it is given (it calls its parts): pass "
                "forward=(model, batch) -> output to say how to call it"
            )
        return seen[0]

    def run_model(self, model: nn.Module, call: ModelCall) -> Any:
        """`call(model)`; a forward that raises here is the setup's, not the doctor's: CannotRun
        with its first line."""
        try:
            return call(model)
        except Exception as e:
            first = (str(e).splitlines() or [""])[0][:120]
            raise CannotRun(
                f"the model raised {type(e).__name__} ({first}) when called as your step calls "
                "it; pass forward=(model, batch) -> output if it needs another call"
            ) from e

    def forward_once(self, model: nn.Module, handles: list[Any]) -> None:
        """One no-grad forward of the first batch (hooks watching it), then `handles` removed."""
        try:
            call = self.call(self.batches[0])
            with torch.no_grad():
                self.run_model(model, call)
        finally:
            for h in handles:
                h.remove()

    def main_input(self, batch: Any) -> tuple[torch.Tensor, Callable[[torch.Tensor], ModelCall]]:
        """The main input tensor of the model's call for `batch`, and a function that makes
        the same call around another tensor (CannotRun when the call holds no tensor)."""
        call = self.call(batch)
        try:
            return call.main_input(), call.with_main
        except ValueError as e:
            raise CannotRun(str(e)) from e

    def same_draws(
        self, model: nn.Module, calls: Sequence[ModelCall], *, train: bool
    ) -> list[torch.Tensor]:
        """The model's main outputs (as float) for each call, every forward from the same RNG
        draws (dropout masks match) and the buffers a forward writes put back; in eval mode
        unless `train` (examine puts every flag back after the check)."""
        if not train:
            model.eval()
        rng, out = capture_rng(), []
        for call in calls:
            restore_rng(rng)
            # each from the same buffers: a forward may write them (power iteration)
            with torch.no_grad(), buffers_restored([model]):
                out.append(self.outputs(model, call).float())
        return out

    def outputs(self, model: nn.Module, call: ModelCall) -> torch.Tensor:
        """The model's main output tensor (logits) for `call`: `.logits`, or its first floating
        tensor. A model that returns only its loss when given targets (`model(x, y)`) is
        called again without them (ModelCall.without_targets); CannotRun if that fails too."""
        t = _main_output(self.run_model(model, call))
        if t is not None and t.dim() == 0 and call.forward is None:
            bare = call.without_targets()
            if bare is not None:
                with contextlib.suppress(CannotRun):
                    t = _main_output(self.run_model(model, bare))
        if t is None or t.dim() == 0:
            what = "only a scalar (a loss)" if t is not None else "no floating tensor"
            raise CannotRun(
                f"the model returns {what}; pass forward=(model, batch) -> per-sample outputs"
            )
        return t


def _main_output(out: Any) -> torch.Tensor | None:
    """`.logits`, or the first floating tensor of a (nested) output."""
    logits = out.get("logits") if isinstance(out, Mapping) else getattr(out, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else first_tensor(out)


# NOTE [one iteration]
# An LBFGS step evaluates the closure up to max_iter (20) times, and the doctor runs the step
# dozens of times: minutes on a small sequence model. Every evaluation runs the same code, so
# what a check reads of one (ops, syncs, leaks, graphs, the update) holds for all; the doctor's
# steps run one iteration each, and the groups' settings are put back after every step.
@contextlib.contextmanager
def _one_iteration(optimizers: Sequence[torch.optim.Optimizer]) -> Iterator[None]:
    """LBFGS groups at max_iter=1 (and max_eval 2) inside the block, their settings after it."""
    groups = [g for o in optimizers if isinstance(o, torch.optim.LBFGS) for g in o.param_groups]
    saved = [(g["max_iter"], g["max_eval"]) for g in groups]
    for g in groups:
        g["max_iter"], g["max_eval"] = 1, 2
    try:
        yield
    finally:
        for g, (iters, evals) in zip(groups, saved, strict=True):
            g["max_iter"], g["max_eval"] = iters, evals


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
