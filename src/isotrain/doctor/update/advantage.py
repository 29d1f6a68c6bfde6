"""The actor's loss against the critic: a policy-gradient term (log-probabilities times an
advantage) whose advantage still carries the critic's graph sends the actor's gradient into the
critic. Judged by an intervention (NOTE [detach and compare])."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from isotrain.doctor.ground.calls import call_site
from isotrain.doctor.ground.context import Context, params_of
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ground.probe import probe_ok
from isotrain.doctor.ground.watch import TORCH_DIR
from isotrain.doctor.update.params import name_list

__all__ = ["ADVANTAGE", "check_advantage"]

# log-probabilities ("log") and probabilities ("prob"), and what is computed from them; a
# product of a "log" tensor with an untagged one is a policy-gradient term (p log p, an
# entropy, and (1 - p)^g log p, a focal loss, multiply two tagged ones; x * sigmoid(x) none)
_LOG = {F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax}
_PROB = {F.softmax, torch.softmax, torch.Tensor.softmax, torch.sigmoid, torch.Tensor.sigmoid,
         F.sigmoid}  # fmt: skip
_LOG_OF = {torch.log, torch.Tensor.log}
_MUL = {torch.mul, torch.multiply, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__}
_DISTRIBUTIONS = os.path.join(TORCH_DIR, "distributions")
_MODULE_CALL = os.path.join(TORCH_DIR, "nn", "modules", "module.py")


def _inside(name: str | None = None) -> bool:
    """Whether torch.distributions code (its `name` method, if given) is running, or (without a
    name) a module's forward: the model's own algorithm, not the step's loss."""
    frame: Any = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith(_DISTRIBUTIONS) and name in (None, code.co_name):
            return True
        if name is None and code.co_filename == _MODULE_CALL and code.co_name == "_call_impl":
            return True
        frame = frame.f_back
    return False


class _PolicyTerms(TorchFunctionMode):
    """Tags the tensors derived from the policy's (log-)probabilities and notes each product of
    one with a per-sample tensor that carries a graph of its own (an advantage not detached);
    with `detach`, that tensor is detached at those lines instead."""

    def __init__(self, detach: set[str] | None = None) -> None:
        super().__init__()
        self.tagged: dict[int, tuple[str, torch.Tensor]] = {}  # id -> (tag, the tensor alive)
        self.sites: dict[str, int] = {}  # the user's file:line of a product -> its count
        self.detach = detach

    def _tag(self, t: Any) -> str | None:
        found = self.tagged.get(id(t)) if isinstance(t, torch.Tensor) else None
        return found[0] if found is not None else None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _MUL and len(args) == 2:
            args = self._product(*args)
        out = func(*args, **kwargs)
        tag = self._result(func, args, kwargs)
        if tag is not None:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.tagged[id(t)] = (tag, t)
        return out

    def _result(self, func: Any, args: Any, kwargs: dict[str, Any]) -> str | None:
        """The tag of `func`'s output: "log", "prob" or None."""
        tags = {self._tag(a) for a in (*args, *kwargs.values())} - {None}
        if func in _LOG or (func in _LOG_OF and "prob" in tags):
            return "log"
        if func in _PROB:
            return "prob"
        if tags:
            return "log" if "log" in tags else "prob"
        return "log" if _grad(args) and _inside("log_prob") else None

    def _product(self, a: Any, b: Any) -> tuple[Any, Any]:
        """(a, b), the untagged one detached where this line is one to detach."""
        tags = (self._tag(a), self._tag(b))
        if set(tags) != {"log", None}:
            return a, b
        policy, other = (a, b) if tags[0] == "log" else (b, a)
        if not (_grad((policy,)) and _grad((other,)) and other.numel() > 1) or _inside():
            return a, b
        where = call_site()[0]
        self.sites[where] = self.sites.get(where, 0) + 1
        if self.detach is None or where not in self.detach:
            return a, b
        return (a, b.detach()) if other is b else (a.detach(), b)


def _grad(args: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in args)


# NOTE [detach and compare]
# Whether the actor's gradient reaches the critic is measured, not guessed from the graph: the
# step runs from examine's state while the products of the policy's log-probabilities with a
# per-sample tensor that carries a graph are noted; it runs again with that tensor detached at
# those lines, and once more as it is. The parameters that end the step differently with the
# advantage detached are those the actor's loss moved through it. Where the critic's optimizer
# clears that gradient before its own backward, nothing differs and nothing is reported; a step
# that ends differently run twice as it is is not judged.
def check_advantage(ctx: Context) -> list[Finding]:
    """advantage_not_detached: the actor's loss moves parameters through its advantage."""
    probe_ok(ctx)
    watched = _PolicyTerms()
    plain = _after(ctx, watched)
    if not watched.sites:
        return []
    sites = set(watched.sites)
    detached = _after(ctx, _PolicyTerms(detach=sites))
    moved = {n: (plain[n] - t).abs().max().item() for n, t in detached.items()
             if not torch.equal(plain[n], t)}  # fmt: skip
    if not moved or any(not torch.equal(plain[n], t) for n, t in _after(ctx, None).items()):
        return []
    where = next(iter(watched.sites))
    return [Finding(
        "advantage_not_detached", "error", where,
        f"this line multiplies the policy's log-probabilities by a per-sample tensor that "
        f"carries a graph of its own (an advantage, return - value): the same step with it "
        f"detached ends with {len(moved)} parameter(s) different ({name_list(sorted(moved))}; "
        f"max |difference| {max(moved.values()):.3g}): the actor's loss trains the critic",
        "detach the advantage in the actor's loss: (returns - values).detach(), or compute it "
        "under torch.no_grad(); the critic learns from its own loss only",
    )]  # fmt: skip


def _after(ctx: Context, mode: TorchFunctionMode | None) -> dict[str, torch.Tensor]:
    """The parameters after one call of the user's step from examine's state, under `mode`."""
    model, opt = ctx.fresh()
    if mode is None:
        ctx.run_step(model, opt, ctx.batches[0])
    else:
        with mode:
            ctx.run_step(model, opt, ctx.batches[0])
    return {n: p.detach().clone() for n, p in params_of(model).items()}


ADVANTAGE = Check(
    "advantage",
    (
        Kind(
            "advantage_not_detached",
            "the actor's loss sends gradient into the critic through an undetached advantage",
        ),
    ),
    check_advantage,
)
