"""The probe: one watched step of the user's own step function on a copy, from their state.

host_sync, unused_parameter, params_unchanged, loss_at_init, overflow_risk and the step's
own leaks all read the same probe, so the step runs once for all of them.
"""

from __future__ import annotations

from typing import Any

import torch

from isotrain.contexts import StateAudit
from isotrain.doctor._context import CannotRun, Context, Probe, as_loss, params_of
from isotrain.doctor._watch import watching

__all__ = ["probe", "probe_ok"]


def probe(ctx: Context) -> Probe:
    """The watched step (cached on `ctx`): loss, params reached by a gradient, params changed."""
    if "probe" in ctx.cache:
        return ctx.cache["probe"]
    model, opt = ctx.copies()
    params = params_of(model)
    got_grad: set[str] = set()
    handles = []
    for name, p in params.items():
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(_mark(got_grad, name)))
    before = {n: p.detach().clone() for n, p in params.items()}
    audit = StateAudit(model, check_rng=False, warn=False)
    loss: Any = None
    error, watch = None, None
    try:
        with audit, watching(numerics=True) as watch:
            loss = ctx.run_step(model, opt, ctx.batches[0])
    except Exception as e:  # the user's step failed: the checks that need it say so
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        for h in handles:
            h.remove()
    audit.restore()
    error = _agreed(ctx, error)
    changed = {n for n, p in params.items() if not torch.equal(p.detach(), before[n])}
    value = as_loss(loss)
    loss_value = float(value.detach().float().mean()) if value is not None else None
    leaks = [d for d in audit.differences if not d.startswith("buffer ")]
    result = Probe(loss_value, got_grad, changed, watch, error, leaks)
    ctx.cache["probe"] = result
    return result


def _agreed(ctx: Context, error: str | None) -> str | None:
    """Under a process group, a step that raised on any rank raised on all of them: the checks
    that need it then stand down together."""
    if ctx.ranks is None:
        return error
    errors = ctx.ranks.gather("the outcome of the probe step", error)
    return error or next((f"{e} (on rank {r})" for r, e in enumerate(errors) if e), None)


def _mark(seen: set[str], name: str) -> Any:
    def hook(p: torch.Tensor) -> None:
        seen.add(name)

    return hook


def probe_ok(ctx: Context) -> Probe:
    """The probe, or CannotRun when the user's step raised."""
    p = probe(ctx)
    if p.error is not None:
        raise CannotRun(f"your step raised {p.error}")
    return p
