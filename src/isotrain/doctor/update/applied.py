"""What each parameter received against what its optimizer's rule gives for the gradient step()
received (NOTE [the rule's update] in update.rule): an update applied twice."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from isotrain.doctor.ground.context import Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.update.params import name_list
from isotrain.doctor.update.rule import Rule, Stepped, judged, norm
from isotrain.doctor.update.writers import writers

__all__ = ["TWICE", "check_twice"]

_FIT = 0.1  # the largest relative residual of a fit that concludes anything
_NOISE = 64  # a change outside step() within this many ulps of the weights is rounding


def _applied(s: Stepped, i: int) -> torch.Tensor:
    return s.post[i].double() - s.pre[i].double()


@dataclass(frozen=True)
class _Twice:
    """Parameters that received an update twice, where, and what was measured."""

    names: list[str]
    where: str
    evidence: str  # follows "N parameter(s) (names) "


def _times(ratio: float) -> str:
    return f"received {ratio:.2f} x the update their optimizer's rule gives once for that gradient"


def _by_two_steps(r: Rule) -> _Twice | None:
    """The same gradient (one .grad object, unchanged) applied by two step() calls that both
    moved the parameter: two optimizers hold it, or step() ran twice."""
    found: dict[int, list[Stepped]] = {}
    for i in dict.fromkeys(i for s in r.steps for i in s.pre):  # in the steps' order
        seen: dict[tuple[int, int], list[Stepped]] = {}
        for s in r.steps:
            if i in s.pre and norm(_applied(s, i)) > 0:
                g, version = s.given[i]
                seen.setdefault((id(g), version), []).append(s)
        same = max(seen.values(), key=len, default=[])
        if len(same) > 1:
            found[i] = same
    if not found:
        return None
    i, steps = next(iter(found.items()))
    got = norm(sum((_applied(s, i) for s in steps), torch.zeros(())))
    once = norm(steps[0].rule[i]) if i in steps[0].rule else norm(_applied(steps[0], i))
    labels = [f"{type(s.opt).__name__} at {s.where}" for s in steps]
    held = "two optimizers hold it" if len({id(s.opt) for s in steps}) > 1 else "step() ran twice"
    how = (
        f"{_times(got / once)}: the same gradient was applied by {len(steps)} "
        f"optimizer.step() calls ({held}: {', '.join(labels)})"
    )
    return _Twice([r.names.get(i, "?") for i in found], steps[-1].where, how)


def _fit(y: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
    """y ~ c * a + d * b by least squares: (c, d, relative residual)."""
    basis = torch.stack([a.reshape(-1), b.reshape(-1)], 1)  # (n, 2)
    coef = torch.linalg.lstsq(basis, y.reshape(-1, 1)).solution.reshape(-1)
    res = norm(y.reshape(-1) - basis @ coef) / max(norm(y), 1e-300)
    return float(coef[0]), float(coef[1]), res


def _by_hand(ctx: Context, r: Rule) -> _Twice | None:
    """Changes the call made outside step() (final - start - what the steps applied) that fit
    c * (the gradients step() received) + d * (the parameter), c < 0, the gradient term most of
    it: a hand-written descent step on top of the optimizer's."""
    hand, cs, ratios = [], [], []
    for i in dict.fromkeys(i for s in r.steps for i in s.pre):  # in the steps' order
        steps = [s for s in r.steps if i in s.pre]
        own = sum((_applied(s, i) for s in steps), torch.zeros(()))
        grads = sum((s.grad[i].double() for s in steps), torch.zeros(()))
        start = r.start[i].double()
        outside = r.final[i].double() - start - own
        noise = _NOISE * torch.finfo(r.start[i].dtype).eps * norm(start)
        if norm(outside) <= noise or norm(grads) == 0:
            continue
        c, _, res = _fit(outside, grads, start)
        if c < 0 and res < _FIT and norm(c * grads) > 0.5 * norm(outside):
            hand.append(i)
            cs.append(c)
            ratios.append(norm(outside) / norm(own) if norm(own) else float("inf"))
    if not hand:
        return None
    lines = writers(ctx, r.call + 1, [r_p for i in hand if (r_p := _param(ctx, i)) is not None])
    where = next((lines[i] for i in hand if i in lines), r.steps[-1].where)
    c, ratio = sorted(cs)[len(cs) // 2], sorted(ratios)[len(ratios) // 2]
    how = (
        f"changed outside optimizer.step() by {c:.3g} x the gradient step() received "
        f"(fit residual under {_FIT:.0%}; {ratio:.2g} x the size of the optimizer's own "
        "update): a hand-written update on top of the optimizer's"
    )
    return _Twice([r.names.get(i, "?") for i in hand], where, how)


def _param(ctx: Context, i: int) -> torch.Tensor | None:
    return next((p for o in ctx.optimizers for g in o.param_groups for p in g["params"]
                 if id(p) == i), None)  # fmt: skip


def check_twice(ctx: Context) -> list[Finding]:
    """update_applied_twice: a parameter received its optimizer's update for one gradient
    twice (two step() calls), or a hand-written update besides it. A tensor listed twice in one
    optimizer is duplicate_parameter's (update.params), read from the groups alone."""
    r = judged(ctx)
    out = []
    for t in (_by_two_steps(r), _by_hand(ctx, r)):
        if t is not None:
            out.append(Finding(
                "update_applied_twice", "error", t.where,
                f"at call {r.call + 1} of your step, {len(t.names)} parameter(s) "
                f"({name_list(t.names)}) {t.evidence}",
                "apply each gradient once: give each tensor to one optimizer and one group, "
                "call step() once per backward (with a GradScaler, scaler.step(opt) alone: it "
                "calls opt.step()), and drop hand-written updates (p.data.add_(-lr * p.grad))",
            ))  # fmt: skip
    return out


TWICE = Check(
    "update_applied_twice",
    (
        Kind(
            "update_applied_twice",
            "a parameter receives its optimizer's update twice for one gradient, or a "
            "hand-written update on top",
        ),
    ),
    check_twice,
)
