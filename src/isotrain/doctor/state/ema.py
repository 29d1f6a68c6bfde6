"""EMA objects: the shadow an exponential moving average keeps follows the parameters.

An EMA the step updates (an object or module it reads by name, holding a copy of the model's
parameters: timm's ModelEma, an `EMA` helper with a dict of shadows) should move each shadow
s toward the parameters p the optimizer just wrote by (1 - decay):
s' = s + (1 - decay) * (p - s). Over a few calls of the user's step the doctor fits the move
s' - s against p_after - s and p_before - s: a negative fraction moves the shadow away (a
flipped sign), a fraction equal to the stated decay is the decay applied the wrong way round,
and a move that follows p_before is an update before optimizer.step(). Warm-up EMAs, whose
fraction changes call to call, and EMAs that do not move in these calls are not judged.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from isotrain.doctor.ground.context import Context, inner
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.globals import StepState
from isotrain.doctor.ground.kinds import Check, Kind

__all__ = ["EMA", "check_ema"]

CALLS = 4
_DECAYS = ("decay", "ema_decay", "beta", "momentum")  # where EMA helpers state their decay
_FIT = 0.2  # the largest relative residual of a fit that explains the shadow's move
_FIX = "s = decay * s + (1 - decay) * p, after optimizer.step(): s.lerp_(p, 1 - decay)"


_Move = tuple[float, float, float | None]  # fraction toward p_after, its residual, toward p_before


@dataclass(frozen=True)
class _Ema:
    """One EMA the step reads: its name, stated decay and (shadow, parameter) pairs."""

    name: str
    decay: float | None
    pairs: list[tuple[torch.Tensor, torch.Tensor]]


def check_ema(ctx: Context) -> list[Finding]:
    """ema_off_decay / ema_before_step: each EMA's shadow move, fitted over a few calls."""
    emas = _emas(ctx)
    if not emas:
        return []
    moves = _moves(ctx, emas)
    return [f for ema in emas for f in _judged(ema, moves[ema.name])]


def _emas(ctx: Context) -> list[_Ema]:
    """The EMAs among what the user's step reads by name (globals and closures)."""
    model = inner(ctx.model)
    params = {_bare(n): p for n, p in model.named_parameters() if p.is_floating_point()}
    found: list[_Ema] = []
    seen = StepState(ctx.step, skip=[*ctx.model.modules(), *ctx.optimizers])
    for _, slot, value, _ in seen.slots:
        name = type(value).__name__ if slot == "cell_contents" else slot  # a closure's cell
        for label, holder in _holders(name, value, model):
            pairs = _pairs(holder, params)
            if pairs and not any(e.name == label for e in found):
                found.append(_Ema(label, _decay(value), pairs))
    return found


def _holders(name: str, value: Any, model: nn.Module) -> Iterator[tuple[str, Any]]:
    """`value` when it holds shadows itself, and its attributes one level deep (a copy of the
    model, a dict or list of shadow tensors) when it is an EMA-like object."""
    if isinstance(value, nn.Module):
        if value is not model:
            yield name, value
        return
    own = type(value).__module__.split(".")[0] not in ("builtins", "torch")
    if not (own and hasattr(value, "__dict__") and _decay(value) is not None):
        return
    for attr, held in vars(value).items():
        if isinstance(held, (nn.Module, dict, list)) and held is not model:
            yield f"{name}.{attr}", held


def _decay(value: Any) -> float | None:
    """The decay an EMA object states (a float in (0, 1) under a usual name), else None."""
    for attr in _DECAYS:
        d = getattr(value, attr, None)
        if isinstance(d, float) and 0.0 < d < 1.0:
            return d
    return None


def _bare(name: str) -> str:
    return name.removeprefix("module.").removeprefix("_orig_mod.")


def _pairs(
    holder: Any, params: Mapping[str, torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(shadow, parameter) pairs: by name for a module or dict, by order for a list; all of
    the model's parameters must have a shadow of their shape, else none."""
    if isinstance(holder, nn.Module):
        named = {_bare(n): t for n, t in holder.state_dict(keep_vars=True).items()}
    elif isinstance(holder, dict):
        named = {_bare(str(k)): t for k, t in holder.items()}
    else:
        named = dict(zip(params, holder, strict=False)) if len(holder) == len(params) else {}
    pairs = [(named.get(n), p) for n, p in params.items()]
    ok = all(isinstance(s, torch.Tensor) and s.shape == p.shape and s is not p for s, p in pairs)
    return [(s.detach(), p) for s, p in pairs] if ok and pairs else []  # type: ignore[union-attr]


def _moves(ctx: Context, emas: list[_Ema]) -> dict[str, list[_Move]]:
    """For each EMA and call: (fraction toward p_after, its residual, residual toward p_before)."""
    out: dict[str, list[_Move]] = {e.name: [] for e in emas}
    model, opt = ctx.fresh()
    try:
        for i in range(CALLS):
            before = {e.name: _values(e) for e in emas}
            ctx.run_step(model, opt, ctx.batches[i % len(ctx.batches)])
            for e in emas:
                fit = _fit(before[e.name], _values(e))
                if fit is not None:
                    out[e.name].append(fit)
    finally:
        ctx.reset()
    return out


def _values(ema: _Ema) -> tuple[torch.Tensor, torch.Tensor]:
    """The shadows and the parameters, each flattened into one float64 vector."""
    with torch.no_grad():
        s = torch.cat([s.reshape(-1).double() for s, _ in ema.pairs])
        p = torch.cat([p.detach().reshape(-1).double() for _, p in ema.pairs])
    return s, p


def _fit(
    before: tuple[torch.Tensor, torch.Tensor], after: tuple[torch.Tensor, torch.Tensor]
) -> _Move | None:
    """The shadow's move fitted as a fraction of p_after - s (and the residuals of that fit
    and of one toward p_before - s); None when the shadow or the parameters did not move."""
    (s0, p0), (s1, p1) = before, after
    move, toward, back = s1 - s0, p1 - s0, p0 - s0
    moved = float(move.norm())  # sync: the doctor's measurement
    if moved == 0.0 or float((p1 - p0).norm()) == 0.0 or float(toward.norm()) == 0.0:
        return None
    a = float(move @ toward) / float(toward @ toward)
    res = float((move - a * toward).norm()) / moved
    back_res = None
    if float(back.norm()) > 0:
        b = float(move @ back) / float(back @ back)
        back_res = float((move - b * back).norm()) / moved
    return a, res, back_res


def _judged(ema: _Ema, moves: list[_Move]) -> list[Finding]:
    """The findings of one EMA's fitted moves (none unless every call moved it)."""
    if len(moves) < CALLS - 1:
        return []
    after = [a for a, res, _ in moves if res < _FIT]
    if len(after) == len(moves):
        away = [a for a in after if a < 0]
        d = ema.decay
        if away:
            return [Finding(
                "ema_off_decay", "error", ema.name,
                f"each update moves the shadow away from the parameters: s' - s = {away[0]:.3g} "
                f"x (p - s), so the average runs off from them ({1 - away[0]:.3g}x the gap "
                "every step)",
                "move the shadow toward p: " + _FIX,
            )]  # fmt: skip
        if d is not None and d > 0.5 and all(abs(a - d) <= 0.1 * (1 - d) for a in after):
            return [Finding(
                "ema_off_decay", "error", ema.name,
                f"each update moves the shadow {after[0]:.3g} of the way to the parameters, "
                f"its stated decay ({d:g}), not 1 - decay ({1 - d:.3g}): the average is "
                "the last step's weights",
                "apply the decay to the shadow: " + _FIX,
            )]  # fmt: skip
        return []
    measured = [(r, rb) for _, r, rb in moves if rb is not None]
    back = [rb for r, rb in measured if rb < _FIT and rb < 0.5 * r]
    if len(back) >= 2 and len(back) == len(measured):
        return [Finding(
            "ema_before_step", "warning", ema.name,
            f"in {len(back)} calls of your step the shadow moved toward the parameters as "
            "they were before optimizer.step(), not after: the EMA averages stale weights "
            "(one step behind, and it never sees the last update)",
            "call the EMA update after optimizer.step() (and after scaler.step/update)",
        )]  # fmt: skip
    return []


EMA = Check(
    "ema",
    (
        Kind("ema_off_decay", "an EMA's shadow moves away from the parameters, or by its decay"),
        Kind("ema_before_step", "an EMA follows the parameters from before optimizer.step()"),
    ),
    check_ema,
)
