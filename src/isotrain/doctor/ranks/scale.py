"""gradient_scaled_by_world: the applied gradient against the one-process gradient of the
global batch.

Data parallel is meant to apply what one process would on the ranks' batches together: the
mean over ranks of each rank's gradient of its own (mean) loss. DistributedDataParallel
already averages, so a loss multiplied or divided by the world size, or an all_reduce SUM of
`.grad` on top of DDP (or one by hand without the divide), applies world_size times too much
or too little. On the first step the applied gradient is the product of two measured factors:
the path's, between the gradients the step's backwards left (their mean over ranks) and those
`optimizer.step()` received, compared through two fixed linear sums per parameter (exact for
a uniform scale, a few numbers per rank exchanged); and the loss's, what the backwards ran on
against the rank's loss. With one backward that loss is the one the step returned. With
several (micro-batches, parts of one loss, chunks) it is read three ways, each exact or not
used: the returned loss against all the backwards ran on; the mean of the loss-function
outputs the backwards scaled (micro-batches); their sum (parts of one loss, which a step
without no_sync may be). NOTE [several backwards] says when that is judged. A step that
gathers tensors across ranks before backward (a contrastive loss over the global batch) may
scale by the world size on purpose and is not judged.
"""

from __future__ import annotations

import math

import torch

from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ranks.backwards import EXACT, Summary

__all__ = ["TOLERANCE", "grad_sums", "scale_finding"]

TOLERANCE = 1e-3  # relative: fp32 sums of the same gradients agree far closer
_PERIOD = 7  # the second linear sum weighs element i by (i mod 7) - 3
KIND = "gradient_scaled_by_world"
_AVERAGED = ("the gradients are averaged over ranks already, by DistributedDataParallel or "
             "your all-reduce: no * or / world_size or dp_size")  # fmt: skip
_MICRO_FIX = (f"scale each micro-batch's loss by 1 / the number of micro-batches and by nothing "
              f"else ({_AVERAGED}); where a library divides by the accumulation steps too, do "
              "not divide again")  # fmt: skip
_PARTS_FIX = f"backward each part of the loss as it is ({_AVERAGED})"

# NOTE [several backwards]
# With m backwards, each reading gives a factor F against the one-process gradient of the
# global batch: the returned loss (F = what the backwards ran on, summed, over it); the mean
# of the loss outputs (F = c * m, each backward having scaled its loss output by the same c on
# every rank: micro-batches, or chunks of one output); their sum (F = c: the parts of one loss,
# or a GAN's real and fake terms). A reading that cannot hold is left out: the sum once no_sync
# shows accumulation; the mean where the backwards share a forward of the model and the step
# returned their loss (chunks return their mean, which the returned reading judges). The step
# is correct if any reading left gives 1. Otherwise the first reading whose factor is the world
# size or the number of backwards, their product, or an inverse of these is reported; any other
# factor (a loss weight, clipping) is not this bug. When no loss reading is available, or the
# ranks ran different numbers of backwards, that is said as information, and only the path's
# factor is judged.


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


def _common(values: list[float | None]) -> float | None:
    """The one value every entry holds (to EXACT), else None."""
    first = values[0] if values else None
    if first is None or any(v is None or not _near(v, first, EXACT) for v in values):
        return None
    return first


def scale_finding(summaries: list[Summary], world: int, *, adaptive: bool) -> list[Finding]:
    """gradient_scaled_by_world from each rank's Summary of its first step; the same on every
    rank. `adaptive`: an Adam-type optimizer, which normalises most of a constant scale away."""
    if any(s.gathers for s in summaries):
        return []  # a loss over gathered tensors: a world-size factor may be right
    if len({(len(s.after), len(s.at_step)) for s in summaries}) > 1:
        return []  # some rank read no gradients: nothing the ranks share to compare
    path = _path_factor([s.after for s in summaries], [s.at_step for s in summaries])
    counts = [s.backwards for s in summaries]
    if len(set(counts)) > 1:
        shown = ", ".join(f"{n} on rank {r}" for r, n in enumerate(counts))
        why = f"the ranks ran different numbers of backwards before optimizer.step() ({shown})"
        judged = [] if path is None else _path_only(world, path, adaptive=adaptive)
        return [_unjudged(why), *judged]
    if path is None:
        return []
    if counts[0] > 1:
        return _several(summaries, world, path, adaptive=adaptive)
    c = _common([s.returned for s in summaries])
    if c is None or not (_near(c, world, EXACT) or _near(c, 1 / world, EXACT)):
        c = 1.0  # another factor (a GradScaler's, an accumulation's): only the path is judged
    total = c * path
    if not (_near(total, world) or _near(total, 1 / world)):
        return []
    causes: list[str] = []
    fix: list[str] = []
    if not _near(c, 1):
        causes.append(f"backward ran on your returned loss x {c:.4g}")
        fix.append("call backward on the loss itself (DistributedDataParallel already averages "
                   "the gradients over ranks: no / world_size or * world_size)")  # fmt: skip
    return [_finding(total, world, "each rank's gradient of the loss it returned", causes, fix,
                     path, adaptive=adaptive)]  # fmt: skip


def _several(summaries: list[Summary], world: int, path: float, *, adaptive: bool) -> list[Finding]:
    """NOTE [several backwards]: m > 1 backwards before optimizer.step() on every rank."""
    m = summaries[0].backwards
    returned = _common([s.returned for s in summaries])
    c = _common([x for s in summaries for x in s.scales])
    layouts = {s.layout for s in summaries}
    layout = layouts.pop() if len(layouts) == 1 else "mixed"
    unsynced = any(s.unsynced for s in summaries)
    readings = _readings(m, returned, c, layout, unsynced=unsynced)
    if any(_near(f * path, 1) for f, _ in readings):
        return []
    if not readings:
        return [_unjudged(_unknown(m, c)), *_path_only(world, path, adaptive=adaptive)]
    ours = [(f * path, ref) for f, ref in readings if _is_ours(f * path, world, m)]
    if not ours:
        return []  # another factor (a loss weight, clipping): not this bug
    total, reference = ours[0]
    why = []
    if returned is not None and not _near(returned, 1):
        why.append(f"your {m} backwards ran on {returned:.4g} x the loss your step returned, "
                   "in all")  # fmt: skip
    names = "/".join(dict.fromkeys(n for s in summaries for n in s.losses))
    if c is not None and layout == "parts":
        why.append(f"each of the {m} parts of one forward's loss ({names}) was backwarded "
                   f"x {c:.4g}")  # fmt: skip
    elif c is not None and layout == "micro-batches":
        why.append(f"each micro-batch's backward ran on its {names} output x {c:.4g}, so {m} "
                   f"of them add up to {c * m:.4g} x their mean"
                   f"{' (no_sync: accumulation)' if unsynced else ''}")  # fmt: skip
    why.append(f"{total:.4g} = {_named(total, world, m)}")
    fix = [] if _near(total / path, 1) else [_PARTS_FIX if layout == "parts" else _MICRO_FIX]
    return [_finding(total, world, reference, why, fix, path, adaptive=adaptive)]


def _readings(
    m: int, returned: float | None, c: float | None, layout: str, *, unsynced: bool
) -> list[tuple[float, str]]:
    """The loss's factor by each reading that can hold, and what it is against (NOTE
    [several backwards])."""
    out = [] if returned is None else [(returned, "each rank's gradient of the loss it returned")]
    if c is None:
        return out
    mean = (c * m, f"each rank's mean gradient of its {m} backwards' losses")
    whole = (c, f"each rank's summed gradient of its {m} backwards' losses")
    if layout == "micro-batches":
        return out + ([mean] if unsynced else [mean, whole])
    if layout == "parts":
        return out + ([whole] if returned is not None else [whole, mean])
    return out


def _unknown(m: int, c: float | None) -> str:
    """Why no reading of several backwards' loss could be made."""
    if c is not None:
        return (f"your {m} backwards neither follow a forward of the model each nor share one, "
                "and their sum is not the loss your step returned")  # fmt: skip
    return (f"not every one of your {m} backwards runs on a mean-reduced loss-function output "
            "(cross_entropy, mse_loss, ...) times one same factor on every rank, and their sum "
            "is not the loss your step returned")  # fmt: skip


def _path_only(world: int, path: float, *, adaptive: bool) -> list[Finding]:
    if not (_near(path, world) or _near(path, 1 / world)):
        return []
    return [_finding(path, world, "each rank's gradient after its last backward", [], [], path,
                     adaptive=adaptive)]  # fmt: skip


def _is_ours(total: float, world: int, m: int) -> bool:
    """Whether `total` is the world size, the number of backwards, their product, or the
    inverse of one of these."""
    return not _near(total, 1) and bool(_named(total, world, m))


def _named(total: float, world: int, m: int) -> str:
    """`total` as the world size and the number of backwards make it ('' if they do not)."""
    terms = {(1, 0): f"the world size {world}", (0, 1): f"the {m} backwards",
             (1, 1): f"the world size {world} x the {m} backwards"}  # fmt: skip
    found = []
    for (a, b), text in terms.items():
        if _near(total, world**a * m**b):
            found.append(text)
        elif _near(total, 1 / (world**a * m**b)):
            found.append(f"1 / ({text})" if a and b else f"1 / {text}")
    return " or ".join(found)


def _finding(
    total: float, world: int, reference: str, why: list[str], fix: list[str], path: float, *,
    adaptive: bool,
) -> Finding:  # fmt: skip
    """The warning: the factor, against what, the measured parts of it, and the fixes."""
    if not _near(path, 1):
        why.append(f"between backward and optimizer.step() the gradients were scaled by "
                   f"{path:.4g} (an all_reduce SUM of .grad on top of DDP's average, or by hand "
                   "without dividing by the world size)")  # fmt: skip
        fix.append("drop the all_reduce of .grad under DistributedDataParallel; by hand, divide "
                   "each all-reduced .grad by dist.get_world_size()")  # fmt: skip
    return Finding(
        KIND, "warning", "optimizer.step()",
        f"at optimizer.step() (step 1) the gradients are {total:.4g} x the mean over {world} "
        f"ranks of {reference}, the one-process gradient of the global batch: "
        f"{'; '.join(why)}. {_effect(total, adaptive=adaptive)}",
        "; ".join(fix),
    )  # fmt: skip


def _unjudged(why: str) -> Finding:
    """Information: the loss's factor could not be judged, and why."""
    return Finding(
        KIND, "info", "optimizer.step()",
        f"not checked: the loss's factor, since {why}; the path from backward to "
        "optimizer.step() is judged alone",
        "-",
    )  # fmt: skip


def _effect(total: float, *, adaptive: bool) -> str:
    """What a constant gradient scale does to the update."""
    if adaptive:
        return (
            "Your Adam-type optimizer normalises most of a constant scale away, but not its eps "
            "nor a clipping threshold, which now act on a gradient that is off by that factor"
        )
    return f"Each step moves {total:.4g} x as far as one process would on the same batches"
