"""optimizer_eps_underflow: the optimizer's own step, on a tensor of its parameters' 16-bit
dtype, makes NaN/Inf from gradients that float32 steps through.

NOTE [probe step]: for each param group holding float16 or bfloat16 parameters, a new optimizer
of the same class with the group's own settings (eps, betas, foreach, fused, ...) steps a
probe tensor of that dtype and device whose gradient holds 0, 1e-4, 1e-3 and 1: an element no
sample reached, one whose square underflows float16, and two ordinary ones. The same step in
float32 is the reference. Adam's `sqrt(exp_avg_sq) + eps` with eps=1e-8 is 0 in float16, so
the first two divide by zero; a fused kernel computes in float32 and stays finite. The user's
optimizers are never stepped.
"""

from __future__ import annotations

from typing import Any

import torch

from isotrain.doctor.ground.context import CannotRun, Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Check, Kind

__all__ = ["EPS_UNDERFLOW", "check_eps"]

_GRADS = (0.0, 1e-4, 1e-3, 1.0)
_LOW = (torch.float16, torch.bfloat16)
_WRAPPED = ("optimizer", "_optimizer", "optim")  # where frameworks keep the optimizer they wrap


def _inner(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer a framework's wrapper delegates to (Fabric's FabricAdamW subclasses AdamW
    but its constructor takes the optimizer it wraps), else `opt`."""
    for _ in range(8):  # wrappers of wrappers, never a cycle
        held = (getattr(opt, name, None) for name in _WRAPPED)
        inside = next((o for o in held if isinstance(o, torch.optim.Optimizer)), None)
        if inside is None or inside is opt:
            return opt
        opt = inside
    return opt


def _probe(opt: torch.optim.Optimizer, settings: dict[str, Any], like: torch.Tensor) -> bool:
    """Whether two steps of a fresh `type(opt)` with `settings` stay finite on a tensor like
    `like` (NOTE [probe step]); raises what the optimizer's constructor or step raises."""
    p = torch.zeros(len(_GRADS), dtype=like.dtype, device=like.device, requires_grad=True)
    build: Any = type(_inner(opt))  # a subclass: its constructor takes the params alone
    probe = build([{"params": [p], **settings}])
    for _ in range(2):
        p.grad = torch.tensor(_GRADS, device=like.device).to(like.dtype)
        probe.step()
    return bool(p.detach().isfinite().all())  # sync: the doctor's measurement


def _cause(settings: dict[str, Any], dtype: torch.dtype) -> str:
    eps = settings.get("eps")
    if isinstance(eps, float) and eps > 0 and float(torch.tensor(eps, dtype=dtype)) == 0:
        dt = str(dtype).removeprefix("torch.")
        return (
            f"eps={eps:g} rounds to 0 in {dt}, so the update divides by zero where a gradient "
            "is 0 or its square underflows"
        )
    return "the step's arithmetic overflows or divides by zero in this dtype"


def _groups(opt: torch.optim.Optimizer) -> list[tuple[int, dict[str, Any], torch.Tensor]]:
    """(index, settings, one parameter) per param group and 16-bit dtype of the parameters it
    steps (those that require grad: NOTE [probe step])."""
    out = []
    for i, group in enumerate(opt.param_groups):
        settings = {k: v for k, v in group.items() if k != "params"}
        kinds = {
            (p.dtype, p.device): p for p in group["params"] if p.dtype in _LOW and p.requires_grad
        }
        out += [(i, settings, p) for p in kinds.values()]
    return out


def check_eps(ctx: Context) -> list[Finding]:
    """optimizer_eps_underflow: NOTE [probe step], per group and 16-bit dtype."""
    out, failed = [], None
    for opt in ctx.optimizers:
        name = type(opt).__name__
        for i, settings, like in _groups(opt):
            try:
                if _probe(opt, settings, like):
                    continue
                wide = _probe(opt, settings, like.detach().float())
            except Exception as e:  # an optimizer a probe cannot rebuild: nothing measured
                failed = f"{name} could not be rebuilt for a probe step: {type(e).__name__}"
                continue
            if not wide:
                continue  # float32 fails too: not a matter of precision
            dt = str(like.dtype).removeprefix("torch.")
            out.append(Finding(
                "optimizer_eps_underflow", "error", f"{name} param group {i} ({dt})",
                f"a probe step of {name} with this group's settings on a {dt} tensor made "
                f"NaN/Inf from gradients {list(_GRADS)}, which float32 steps through: "
                f"{_cause(settings, like.dtype)}",
                "keep float32 parameters and train under torch.autocast(device_type, "
                "dtype=...) (with a GradScaler for float16); or pass an eps the dtype holds "
                f"(eps=1e-4 for float16), or fused=True where {name} has it (it computes in "
                "float32)",
            ))  # fmt: skip
    if failed and not out:
        raise CannotRun(failed)
    return out


EPS_UNDERFLOW = Check(
    "optimizer_eps_underflow",
    (Kind("optimizer_eps_underflow", "the optimizer's step makes NaN/Inf on parameters of "
          "their 16-bit dtype (eps rounds to 0)"),),
    check_eps,
)  # fmt: skip
