"""gradient_scaled_by_world: the applied gradient against the one-process gradient of the
global batch.

Data parallel is meant to apply what one process would on the ranks' batches together: the
mean over ranks of each rank's gradient of its own (mean) loss. DistributedDataParallel
already averages, so a loss multiplied or divided by the world size, or an all_reduce SUM of
`.grad` on top of DDP (or one by hand without the divide), applies world_size times too much
or too little. Two factors are measured, each against what the doctor can compute on the
first step: the tensor backward ran on against the loss the step returned (one backward), and
the gradients `optimizer.step()` received against the mean over ranks of those backward
left, compared through two fixed linear sums per parameter (exact for a uniform scale, a
few numbers per rank exchanged). Their product is judged only when it is the world size or
its inverse; a step that gathers tensors across ranks before backward (a contrastive loss over
the global batch) may scale by the world size on purpose and is not judged.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from isotrain.doctor.ground.finding import Finding

__all__ = ["TOLERANCE", "grad_sums", "loss_ratio", "scale_finding"]

TOLERANCE = 1e-3  # relative: fp32 sums of the same gradients agree far closer
# relative, for the loss backward ran on over the loss returned: a factor applied to the same
# fp32 number is exact to ~1e-7, while two ranks' losses at initialisation (all near log C)
# can agree to 1e-3, so a returned sum over ranks must not pass for a world-size factor
EXACT = 1e-5
_PERIOD = 7  # the second linear sum weighs element i by (i mod 7) - 3


def grad_sums(grads: dict[str, torch.Tensor]) -> list[float]:
    """Two linear sums of each gradient (plain, and weighted by a fixed pattern), in float64:
    a uniform scale of the gradients scales them all alike."""
    out: list[torch.Tensor] = []
    for g in grads.values():
        local = getattr(g, "to_local", None)  # a replicated DTensor: this rank's full copy
        flat = (local() if callable(local) else g).detach().reshape(-1).double()
        weights = torch.arange(flat.numel(), device=flat.device) % _PERIOD - _PERIOD // 2
        out += [flat.sum(), (flat * weights).sum()]
    return torch.stack(out).tolist() if out else []  # sync: once, after the step


def loss_ratio(backwards: list[torch.Tensor], returned: Any) -> float | None:
    """What backward ran on over the loss the step returned, for one backward of a scalar
    (None otherwise: several micro-batches, or no loss returned)."""
    if len(backwards) != 1:
        return None
    value = returned.detach() if isinstance(returned, torch.Tensor) else returned
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = float(value)  # sync: once, after the step
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value == 0:
        return None
    ratio = float(backwards[0]) / value
    return ratio if math.isfinite(ratio) and ratio != 0 else None


def _path_factor(before: list[list[float]], after: list[list[float]]) -> float | None:
    """The uniform factor between the mean over ranks of the gradients backward left and the
    gradients optimizer.step() received (None: no gradient, or not one uniform factor)."""
    a = torch.tensor(before, dtype=torch.float64).mean(0)
    b = torch.tensor(after, dtype=torch.float64).mean(0)
    norm = float(a.dot(a))
    if norm == 0 or not math.isfinite(norm):
        return None
    k = float(a.dot(b)) / norm
    residual = float((b - k * a).norm()) / max(float(b.norm()), 1e-300)
    return k if residual < TOLERANCE else None


def _near(x: float, target: float, tolerance: float = TOLERANCE) -> bool:
    return abs(x - target) <= tolerance * abs(target)


def scale_finding(
    summaries: list[tuple[float | None, list[float], list[float], int]], world: int, *,
    adaptive: bool,
) -> list[Finding]:  # fmt: skip
    """gradient_scaled_by_world from each rank's (loss ratio, sums after backward, sums at
    optimizer.step(), gathers before backward); the same on every rank. `adaptive`: an
    Adam-type optimizer, which normalises most of a constant scale away."""
    if any(gathers for *_, gathers in summaries):
        return []  # a loss over gathered tensors: a world-size factor may be right
    if len({(len(s[1]), len(s[2])) for s in summaries}) > 1:
        return []  # some rank read no gradients: nothing the ranks share to compare
    ratios = [r for r, *_ in summaries]
    first = ratios[0]
    alike = first is not None and all(r is not None and _near(r, first, EXACT) for r in ratios)
    c = first if alike and first is not None else 1.0
    if not (_near(c, world, EXACT) or _near(c, 1 / world, EXACT)):
        c = 1.0  # another factor (a GradScaler's, an accumulation's): only the path is judged
    k = _path_factor([s[1] for s in summaries], [s[2] for s in summaries])
    if k is None:
        return []
    total = c * k
    if not (_near(total, world) or _near(total, 1 / world)):
        return []
    why, fix = [], []
    if not _near(c, 1):
        why.append(f"backward ran on your returned loss x {c:.4g}")
        fix.append("call backward on the loss itself (DistributedDataParallel already averages "
                   "the gradients over ranks: no / world_size or * world_size)")  # fmt: skip
    if not _near(k, 1):
        why.append(f"between backward and optimizer.step() the gradients were scaled by {k:.4g} "
                   "(an all_reduce SUM of .grad on top of DDP's average, or by hand without "
                   "dividing by the world size)")  # fmt: skip
        fix.append("drop the all_reduce of .grad under DistributedDataParallel; by hand, divide "
                   "each all-reduced .grad by dist.get_world_size()")  # fmt: skip
    return [Finding(
        "gradient_scaled_by_world", "warning", "optimizer.step()",
        f"at optimizer.step() (step 1) the gradients are {total:.4g} x the mean over {world} "
        f"ranks of each rank's gradient of the loss it returned, the one-process gradient of "
        f"the global batch: {'; '.join(why)}. {_effect(total, adaptive=adaptive)}",
        "; ".join(fix),
    )]  # fmt: skip


def _effect(total: float, *, adaptive: bool) -> str:
    """What a constant gradient scale does to the update."""
    if adaptive:
        return (
            "Your Adam-type optimizer normalises most of a constant scale away, but not its eps "
            "nor a clipping threshold, which now act on a gradient that is off by that factor"
        )
    return f"Each step moves {total:.4g} x as far as one process would on the same batches"
