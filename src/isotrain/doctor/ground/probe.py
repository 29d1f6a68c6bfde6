"""The probe: one watched step of the user's own step function, from the state examine found.

host_sync, unused_parameter, params_unchanged, loss_at_init, overflow_risk and the step's
own leaks all read the same probe, so the step runs once for all of them. Hooks note which
parameters a gradient reached (and whether it was all zeros) and, after each optimizer step,
which gradients the update saw; their own ops are paused in the watch (not the user's).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from isotrain.contexts import StateAudit
from isotrain.doctor.ground.context import CannotRun, Context, Probe, as_loss, params_of
from isotrain.doctor.ground.watch import OpWatch, local, watching

__all__ = ["probe", "probe_ok"]


class _Grads:
    """What the hooks saw of each parameter's gradient during the step."""

    def __init__(self, watch: OpWatch) -> None:
        self.watch = watch
        self.reached: set[str] = set()
        self.nonzero: set[str] = set()  # some backward gave it a nonzero gradient
        self.at_update: dict[str, bool] = {}  # name -> nonzero gradient after optimizer.step
        self.finite = True

    def accumulated(self, name: str) -> Any:
        def hook(p: torch.Tensor) -> None:
            self.reached.add(name)
            with self.watch.pause():
                if p.grad is not None and bool(local(p.grad).count_nonzero()):
                    self.nonzero.add(name)

        return hook

    def stepped(self, names: dict[int, str]) -> Any:
        def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            with self.watch.pause():
                for group in opt.param_groups:
                    for p in group["params"]:
                        g = None if p.grad is None else local(p.grad)
                        nz = g is not None and bool(g.count_nonzero())
                        self.at_update[names.get(id(p), "?")] = nz
                        self.finite = self.finite and (g is None or bool(g.isfinite().all()))

        return hook


def probe(ctx: Context) -> Probe:
    """The watched step (cached on `ctx`): loss, params reached by a gradient, params changed."""
    if "probe" in ctx.cache:
        return ctx.cache["probe"]
    model, opt = ctx.fresh()
    params = params_of(model)
    names = {id(p): n for n, p in params.items()}
    before = {n: p.detach().clone() for n, p in params.items()}
    audit = StateAudit(model, check_rng=False, warn=False)
    loss: Any = None
    error = None
    with audit, watching(numerics=True) as watch:
        grads = _Grads(watch)
        handles = [
            p.register_post_accumulate_grad_hook(grads.accumulated(n))
            for n, p in params.items()
            if p.requires_grad
        ]
        handles += [o.register_step_post_hook(grads.stepped(names)) for o in ctx.optimizers]
        try:
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
    lost = {n for n in grads.nonzero if not grads.at_update.get(n, True)}
    finite = grads.finite and (loss_value is None or math.isfinite(loss_value))
    result = Probe(loss_value, grads.reached, changed, watch, error, leaks,
                   grads.reached - grads.nonzero, lost, finite)  # fmt: skip
    ctx.cache["probe"] = result
    return result


def _agreed(ctx: Context, error: str | None) -> str | None:
    """Under a process group, a step that raised on any rank raised on all of them: the checks
    that need it then stand down together."""
    if ctx.ranks is None:
        return error
    errors = ctx.ranks.gather("the outcome of the probe step", error)
    return error or next((f"{e} (on rank {r})" for r, e in enumerate(errors) if e), None)


def probe_ok(ctx: Context) -> Probe:
    """The probe, or CannotRun when the user's step raised."""
    p = probe(ctx)
    if p.error is not None:
        raise CannotRun(f"your step raised {p.error}")
    return p
