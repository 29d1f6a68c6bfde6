"""class_weight_order: a class-weighted loss whose weights follow how often each class is seen.

Per-class weights balance the classes: a class seen half as often weighs about twice as much.
The doctor reads every `cross_entropy` / `nll_loss` call with a `weight` in the traced calls,
counts the class targets those calls were given, and names weights that give the classes seen
most the most weight: NOTE [class weights].
"""

from __future__ import annotations

import torch

from isotrain.doctor.ground.calls import LossCall
from isotrain.doctor.ground.context import Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ground.trace import trace_ok

__all__ = ["CLASS_WEIGHTS", "check_class_weights"]

# NOTE [class weights]
# Over the traced calls, the class targets a weighted loss line was given (ignore_index left
# out) give each class's frequency f_c; classes seen fewer than MIN_SEEN times are left out,
# and at least two must remain, MIN_TARGETS targets in all, with max f / min f >= SPREAD
# (balanced data says nothing about the weights' order). The weights are judged only when
# they leave the classes unbalanced by SPREAD or more (max over min of w_c * f_c): right
# weights stay within it though the frequencies are sampled from a few batches, and two
# classes of near frequencies swapped by that sampling never reach it. Two shapes are named:
# weights proportional to the frequencies (w_c / f_c alike within TOL: the frequencies, or for
# two classes each other's inverse, passed where the inverse was meant), and the inverse
# frequencies in another order (sorted w against sorted 1/f alike within TOL: a Counter's or
# value_counts' order, not the class ids'). Hand-set costs that fit neither are not judged.
MIN_SEEN = 8
MIN_TARGETS = 64
SPREAD = 2.0
TOL = 1.35
_FIX = (
    "index the weights by class id: counts = torch.bincount(train_targets, minlength=C); "
    "weight = counts.sum() / (C * counts) (not Counter(labels).values() or value_counts(), "
    "whose order is first seen or most common, and not the frequencies themselves)"
)


def _alike(values: torch.Tensor) -> bool:
    """All positive and within a factor TOL of each other."""
    return bool(values.min() > 0) and float(values.max() / values.min()) <= TOL


def _judged(where: str, calls: list[LossCall]) -> Finding | None:
    """The finding of one weighted loss line, or None when its weights are not misordered."""
    weight = calls[0].weight
    assert weight is not None
    ignore = calls[0].ignore_index
    targets = torch.cat([c.target.flatten() for c in calls if c.target is not None])
    targets = targets[(targets != ignore) & (targets >= 0) & (targets < len(weight))]
    counts = torch.bincount(targets, minlength=len(weight)).double()
    seen = counts >= MIN_SEEN
    if int(seen.sum()) < 2 or float(counts[seen].sum()) < MIN_TARGETS:
        return None
    f, w = counts[seen] / counts[seen].sum(), weight[seen].double()
    balance = w * f
    if float(w.min()) <= 0 or float(f.max() / f.min()) < SPREAD:
        return None
    if float(balance.max() / balance.min()) < SPREAD:
        return None  # the weights balance the classes, or nearly
    if _alike(w / f):
        how = "proportional to how often each class is seen (w_c / f_c alike), not to its inverse"
    elif _alike(w.sort().values / (1 / f).sort().values):
        how = "the classes' inverse frequencies, but in another order than the class ids"
    else:
        return None
    ids = torch.nonzero(seen).flatten().tolist()
    shown = ", ".join(f"class {c}: f {fc:.3f}, w {wc:.3g}"
                      for c, fc, wc in zip(ids, f.tolist(), w.tolist(), strict=True))  # fmt: skip
    name = calls[0].name
    return Finding(
        "class_weight_order", "warning", where,
        f"{name}'s per-class weight is {how}: in the {len(targets)} class targets of the "
        f"traced calls ({shown}) the most frequent class gets the most weight, so the "
        "weighting unbalances the classes further instead of balancing them",
        _FIX,
    )  # fmt: skip


def check_class_weights(ctx: Context) -> list[Finding]:
    """class_weight_order: each weighted class-index loss line against its targets' counts."""
    lines: dict[str, list[LossCall]] = {}
    for c in trace_ok(ctx).watch.calls:
        if c.weight is not None and c.target is not None and c.weight.dim() == 1:
            lines.setdefault(c.where, []).append(c)
    found = (_judged(where, calls) for where, calls in lines.items())
    return [f for f in found if f is not None]


CLASS_WEIGHTS = Check(
    "class_weight_order",
    (
        Kind(
            "class_weight_order",
            "a class-weighted loss gives the classes seen most the most weight (the "
            "frequencies, or their inverse in another order)",
        ),
    ),
    check_class_weights,
)
