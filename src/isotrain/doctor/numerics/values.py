"""Numbers that go wrong: the first NaN/Inf, values near overflow, and steps that differ.

nonfinite_forward hooks every module of a copy and names the first one whose output is not
finite (with its input ranges); the probe's op watch adds ops outside modules (a loss's
log(0)) and the exp / log / softmax inputs near the edge; nondeterminism runs the same step
twice from the same state and seed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from isotrain._torch_private import tree_leaves
from isotrain.doctor.ground.context import Context, as_loss, params_of
from isotrain.doctor.ground.finding import Finding, Severity
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ground.probe import probe_ok
from isotrain.doctor.ground.watch import bad_values, value_ranges

__all__ = [
    "NONDETERMINISM",
    "NONFINITE",
    "OVERFLOW",
    "check_nondeterminism",
    "check_nonfinite",
    "check_overflow",
]

_NAN_FIX = (
    "guard the source: clamp before log (torch.log(p.clamp_min(1e-12)) or log_softmax), "
    "subtract the max before exp (torch.softmax), scale attention scores by 1/sqrt(head_dim); "
    "isotrain.guard.StepGuard keeps a NaN step out of the weights meanwhile"
)


def _nonfinite(out: Any) -> int:
    return sum(
        bad_values(t)
        for t in tree_leaves(out)
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    )


@contextmanager
def _first_nonfinite(model: nn.Module) -> Iterator[list[tuple[str, str]]]:
    """Forward hooks on every module: the first (in completion order) with a NaN/Inf output."""
    found: list[tuple[str, str]] = []
    handles = []
    for name, m in model.named_modules():

        def hook(mod: nn.Module, args: Any, out: Any, label: str = name or "<root>") -> None:
            if not found and (bad := _nonfinite(out)):
                found.append(
                    (label, f"{bad} NaN/+Inf value(s) in its output; inputs {value_ranges(args)}")
                )

        handles.append(m.register_forward_hook(hook))
    try:
        yield found
    finally:
        for h in handles:
            h.remove()


def check_nonfinite(ctx: Context) -> list[Finding]:
    """nonfinite_forward: the first module (or, outside modules, op) that makes a NaN/Inf."""
    call = ctx.call(ctx.batches[0])
    model, _ = ctx.fresh()
    with _first_nonfinite(model) as found, torch.no_grad():
        ctx.run_model(model, call)
    if found:
        where, evidence = found[0]
        return [Finding("nonfinite_forward", "error", where, evidence, _NAN_FIX)]
    p = probe_ok(ctx)
    if p.watch.nonfinite is not None:
        op, where, ranges = p.watch.nonfinite
        evidence = f"{op} made the step's first NaN/Inf (outside any module); its inputs {ranges}"
        return [Finding("nonfinite_forward", "error", where, evidence, _NAN_FIX)]
    if p.watch.given is not None and not p.finite:  # NOTE [a given inf] in ground.watch
        op, where, ranges = p.watch.given
        evidence = (
            f"{op} turned a NaN/Inf number your code passed it into the step's first NaN/Inf "
            f"(outside any module), and the loss or a gradient at the update is not finite; "
            f"its inputs {ranges}"
        )
        return [Finding("nonfinite_forward", "error", where, evidence, _NAN_FIX)]
    return []


def check_overflow(ctx: Context) -> list[Finding]:
    """overflow_risk: exp/log/softmax inputs and low-precision activations near the edge; a
    warning in the user's code, info inside a library or where a log(0)'s -inf was masked
    out before the loss (the step's loss and every gradient finite)."""
    p = probe_ok(ctx)
    out = []
    for (where, what), evidence in sorted(p.watch.risks.items()):
        sev: Severity = "warning"
        fix = _NAN_FIX
        if where in p.watch.library_risks:
            sev, evidence = "info", evidence + " (inside an installed library, not your code)"
            fix = "none needed while the loss stays finite"
        elif what == "log" and p.finite:
            sev, fix = "info", "none needed while the -inf stays masked (torch.where, masked_fill)"
            evidence += "; the -inf never reached the loss or a gradient (masked out)"
        out.append(Finding("overflow_risk", sev, where, evidence, fix))
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit the same values, a NaN where the other has a NaN too (a step that makes
    NaN twice from the same state is deterministic)."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def check_nondeterminism(ctx: Context) -> list[Finding]:
    """nondeterminism: two runs of the step from the same state and RNG seed must agree."""
    probe_ok(ctx)
    results = []
    for _ in range(2):
        model, opt = ctx.fresh()
        loss = as_loss(ctx.run_step(model, opt, ctx.batches[0]))
        values = {n: p.detach().clone() for n, p in params_of(model).items()}
        results.append((values, None if loss is None else loss.detach().clone()))
    (a, la), (b, lb) = results
    differ = [n for n, p in a.items() if not _same(p, b[n])]
    loss_differs = la is not None and lb is not None and not _same(la, lb)
    if not differ and not loss_differs:
        return []
    what = f"{len(differ)} parameter(s) (e.g. {differ[0]})" if differ else "the loss"
    return [Finding(
        "nondeterminism", "warning", "your step",
        f"the same step from the same state and RNG seed gave different {what} twice",
        "draw random numbers from the global generators or from a seeded torch.Generator / "
        "numpy.random.default_rng(seed), never from time or an unseeded generator; "
        "torch.use_deterministic_algorithms(True) for nondeterministic kernels",
    )]  # fmt: skip


NONFINITE = Check(
    "nonfinite",
    (Kind("nonfinite_forward", "the first module whose output is NaN or Inf"),),
    check_nonfinite,
)


OVERFLOW = Check(
    "overflow",
    (Kind("overflow_risk", "activations, softmax, exp or log inputs near overflow or underflow"),),
    check_overflow,
)


NONDETERMINISM = Check(
    "nondeterminism",
    (Kind("nondeterminism", "the same step from the same state and seed gives another result"),),
    check_nondeterminism,
)
