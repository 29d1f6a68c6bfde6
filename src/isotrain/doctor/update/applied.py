"""What each parameter received against what its optimizer's rule gives for the gradient step()
received (NOTE [the rule's update] in update.rule): an update applied twice, and an update
rounded away in a float16/bfloat16 parameter."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from isotrain.doctor.ground.context import CannotRun, Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.update.params import name_list
from isotrain.doctor.update.rule import LOW, Rule, Stepped, rule
from isotrain.doctor.update.writers import writers

__all__ = ["ROUNDING", "TWICE", "check_rounding", "check_twice"]

_FIT = 0.1  # the largest relative residual of a fit that concludes anything
_NOISE = 64  # a change outside step() within this many ulps of the weights is rounding


def _judged(ctx: Context) -> Rule:
    r = rule(ctx)
    if r.closure:
        raise CannotRun("optimizer.step(closure) evaluates the loss itself (LBFGS): its update "
                        "is its own line search, not one rule on one gradient")  # fmt: skip
    if not any(s.pre for s in r.steps):
        why = "every gradient step() received was sparse" if r.sparse else "no gradient"
        raise CannotRun(f"optimizer.step() ran with {why}: nothing to compare")
    return r


def _norm(t: torch.Tensor) -> float:
    return float(t.double().norm())  # sync: the doctor's measurement


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
    for i in {i for s in r.steps for i in s.pre}:
        seen: dict[tuple[int, int], list[Stepped]] = {}
        for s in r.steps:
            if i in s.pre and _norm(_applied(s, i)) > 0:
                g, version = s.given[i]
                seen.setdefault((id(g), version), []).append(s)
        same = max(seen.values(), key=len, default=[])
        if len(same) > 1:
            found[i] = same
    if not found:
        return None
    i, steps = next(iter(found.items()))
    got = _norm(sum((_applied(s, i) for s in steps), torch.zeros(())))
    once = _norm(steps[0].rule[i]) if i in steps[0].rule else _norm(_applied(steps[0], i))
    labels = [f"{type(s.opt).__name__} at {s.where}" for s in steps]
    held = "two optimizers hold it" if len({id(s.opt) for s in steps}) > 1 else "step() ran twice"
    how = (
        f"{_times(got / once)}: the same gradient was applied by {len(steps)} "
        f"optimizer.step() calls ({held}: {', '.join(labels)})"
    )
    return _Twice([r.names.get(i, "?") for i in found], steps[-1].where, how)


def _listed_twice(r: Rule) -> _Twice | None:
    """One step() that moved a parameter it lists twice by more than its rule's update once."""
    for s in r.steps:
        listed = [i for m in s.members for i in m]
        twice = [i for i in dict.fromkeys(listed) if listed.count(i) > 1 and i in s.rule]
        moved = [i for i in twice if _norm(_applied(s, i) - s.rule[i]) > 0.25 * _norm(s.rule[i])]
        if moved:
            i = moved[0]
            ratio = _norm(_applied(s, i)) / _norm(s.rule[i])
            how = (
                f"{_times(ratio)} in one step(): {type(s.opt).__name__} lists them "
                f"{listed.count(i)} times in its param groups"
            )
            return _Twice([r.names.get(i, "?") for i in moved], s.where, how)
    return None


def _fit(y: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
    """y ~ c * a + d * b by least squares: (c, d, relative residual)."""
    basis = torch.stack([a.reshape(-1), b.reshape(-1)], 1)  # (n, 2)
    coef = torch.linalg.lstsq(basis, y.reshape(-1, 1)).solution.reshape(-1)
    res = _norm(y.reshape(-1) - basis @ coef) / max(_norm(y), 1e-300)
    return float(coef[0]), float(coef[1]), res


def _by_hand(ctx: Context, r: Rule) -> _Twice | None:
    """Changes the call made outside step() (final - start - what the steps applied) that fit
    c * (the gradients step() received) + d * (the parameter), c < 0, the gradient term most of
    it: a hand-written descent step on top of the optimizer's."""
    hand, cs, ratios = [], [], []
    for i in {i for s in r.steps for i in s.pre}:
        steps = [s for s in r.steps if i in s.pre]
        own = sum((_applied(s, i) for s in steps), torch.zeros(()))
        grads = sum((s.grad[i].double() for s in steps), torch.zeros(()))
        start = r.start[i].double()
        outside = r.final[i].double() - start - own
        noise = _NOISE * torch.finfo(r.start[i].dtype).eps * _norm(start)
        if _norm(outside) <= noise or _norm(grads) == 0:
            continue
        c, _, res = _fit(outside, grads, start)
        if c < 0 and res < _FIT and _norm(c * grads) > 0.5 * _norm(outside):
            hand.append(i)
            cs.append(c)
            ratios.append(_norm(outside) / _norm(own))
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
    twice (two step() calls, a listing twice), or a hand-written update besides it."""
    r = _judged(ctx)
    out = []
    for t in (_by_two_steps(r), _listed_twice(r), _by_hand(ctx, r)):
        if t is not None:
            out.append(Finding(
                "update_applied_twice", "error", t.where,
                f"at call {r.call + 1} of your step, {len(t.names)} parameter(s) "
                f"({name_list(t.names)}) {t.evidence}",
                "apply each gradient once: give each tensor to one optimizer and one group, "
                "call step() once per backward (with a GradScaler, scaler.step(opt) alone: it "
                "calls opt.step()), and drop hand-written updates (p.data.add_(-lr * p.grad))",
            ))  # fmt: skip
    failed = next((s.error for s in r.steps if s.error is not None), None)
    if failed is not None and not out:
        out.append(Finding(
            "update_applied_twice", "info", r.steps[0].where,
            f"partly checked: {failed}; a tensor listed twice in one step() is not judged "
            "(two step() calls on one gradient and hand-written updates are)",
            "-",
        ))  # fmt: skip
    return out


def check_rounding(ctx: Context) -> list[Finding]:
    """update_lost_to_rounding: float16/bfloat16 parameters whose stored value did not change
    at step() where the rule's float32 update is nonzero, by the size of the update lost (an
    optimizer that rounds stochastically or keeps the remainder in its state loses none)."""
    r = rule(ctx)
    low = {id(s): [i for i in s.pre if s.pre[i].dtype in LOW] for s in r.steps}
    if not any(low.values()):
        return []
    r = _judged(ctx)
    failed = next((s.error for s in r.steps if low[id(s)] and s.error is not None), None)
    if failed is not None:
        raise CannotRun(failed)
    counts, names = [0, 0], dict[str, int]()
    mass = [0.0, 0.0]
    for s in r.steps:
        if not low[id(s)] or _stochastic(s, low[id(s)]):
            continue
        for i in low[id(s)]:
            if _compensated(s, i):
                continue
            moves, still = s.rule[i] != 0, (s.rule[i] != 0) & (s.post[i] == s.pre[i])
            size = s.rule[i].double().abs()
            counts = [counts[0] + int(moves.sum()), counts[1] + int(still.sum())]
            mass = [mass[0] + float(size[still].sum()), mass[1] + float(size.sum())]
            if still.any():
                names[r.names.get(i, "?")] = names.get(r.names.get(i, "?"), 0) + int(still.sum())
    lost = mass[0] / mass[1] if mass[1] else 0.0
    if lost < 0.1:
        return []
    s0 = next(s for s in r.steps if low[id(s)])
    dtype = str(s0.pre[low[id(s0)][0]].dtype).removeprefix("torch.")
    worst = sorted(names, key=names.__getitem__, reverse=True)
    return [Finding(
        "update_lost_to_rounding", "error" if lost >= 0.5 else "warning", s0.where,
        f"at call {r.call + 1} of your step, {counts[1]} of {counts[0]} elements of "
        f"{len(names)} {dtype} parameter(s) ({name_list(worst)}) kept their stored value at "
        f"optimizer.step() though their optimizer's rule, in float32, moves them: {lost:.0%} of "
        f"the update's size is lost; each of those updates is below half the spacing of "
        f"{dtype} numbers at its weight and rounds away",
        "keep the parameters in float32 (master weights) and run the forward under "
        "torch.autocast(device_type, dtype=torch.bfloat16); or step them with an optimizer that "
        "compensates (Kahan summation, or stochastic rounding as torchao's "
        "AdamW(bf16_stochastic_round=True))",
    )]  # fmt: skip


def _stochastic(s: Stepped, ids: list[int]) -> bool:
    """Whether s's optimizer rounds stochastically: where round-to-nearest would leave the
    stored value as it was, the values still moved (in the rule's direction) by at least a
    quarter of the rule's update; an unbiased rounding moves them by all of it on average."""
    moved = expected = 0.0
    for i in ids:
        pre, post, u = s.pre[i], s.post[i], s.rule[i]
        kept = (u != 0) & ((pre.float() + u).to(pre.dtype) == pre)
        step = (post.double() - pre.double()) * u.double().sign()
        moved += float(step[kept].sum())
        expected += float(u.double()[kept].abs().sum())
    return expected > 0 and moved >= 0.25 * expected


def _compensated(s: Stepped, i: int) -> bool:
    """Whether the optimizer's state keeps what rounding lost of this parameter's update (a
    Kahan-summation buffer): a state tensor shaped like it holding +-(pre + u - post)."""
    still = (s.rule[i] != 0) & (s.post[i] == s.pre[i])
    rest = (s.pre[i].double() + s.rule[i].double() - s.post[i].double())[still]
    if not rest.numel():
        return False
    near = 0.5 * _norm(rest)
    return any(
        min(_norm(t.double()[still] - rest), _norm(t.double()[still] + rest)) <= near
        for t in s.kept.get(i, [])
    )


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


ROUNDING = Check(
    "update_lost_to_rounding",
    (
        Kind(
            "update_lost_to_rounding",
            "a float16/bfloat16 parameter's update rounds away: its stored value does not move",
        ),
    ),
    check_rounding,
)
