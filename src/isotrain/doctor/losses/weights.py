"""class_weight_order: a class-weighted loss whose weights follow how often each class is seen.

Per-class weights balance the classes: a class seen half as often weighs about twice as much.
The doctor reads every `cross_entropy` / `nll_loss` call with a `weight` in the traced calls,
counts the class targets those calls were given, and names weights that give the classes seen
most the most weight: NOTE [class weights]; and a `binary_cross_entropy_with_logits`
`pos_weight` that gives the labels with the rarest positives the least: NOTE [positive
weights].
"""

from __future__ import annotations

import math

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


def _missed(w: torch.Tensor, right: torch.Tensor) -> str | None:
    """How weights `w` miss `right`, the weights that balance (up to a scale), when they leave
    them SPREAD or more apart: "inverse" (w x right alike), "order" (sorted, alike), or None."""
    apart = w / right
    if float(apart.max() / apart.min()) < SPREAD:
        return None  # they balance, or nearly
    if _alike(w * right):
        return "inverse"
    return "order" if _alike(w.sort().values / right.sort().values) else None


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
    if float(w.min()) <= 0 or float(f.max() / f.min()) < SPREAD:
        return None
    how = {
        "inverse": "proportional to how often each class is seen (w_c / f_c alike), not to its "
        "inverse",
        "order": "the classes' inverse frequencies, but in another order than the class ids",
    }.get(_missed(w, 1 / f) or "")
    if how is None:
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


# NOTE [positive weights]
# BCE-with-logits' pos_weight balances each label's positives against its negatives: the
# docs' 300 negatives / 100 positives = 3. Over the traced calls each label's positive and
# negative targets give r_l = negatives / positives (labels with fewer than MIN_SEEN of either
# left out, at least two left, MIN_TARGETS rows, max r / min r >= SPREAD); pos_weight is judged
# when it leaves the labels SPREAD or more from balanced (max over min of w_l / r_l), as
# class weights are: named when it is the inverse of the ratios (w_l * r_l alike: positives
# over negatives) or the ratios in another order (sorted, alike). A single label is not
# judged: a pos_weight below 1 may trade recall for precision on purpose.
def _judged_positive(where: str, calls: list[LossCall]) -> Finding | None:
    """class_weight_order of one pos_weight line (NOTE [positive weights])."""
    weight = calls[0].pos_weight
    counts = [c.positives for c in calls if c.positives is not None]
    if weight is None or any(len(p) != len(weight) for p in counts):
        return None
    rows = sum(math.prod(c.target_shape) // len(weight) for c in calls)
    pos = torch.stack(counts).sum(0).double()
    neg = rows - pos
    seen = (pos >= MIN_SEEN) & (neg >= MIN_SEEN)
    if int(seen.sum()) < 2 or rows < MIN_TARGETS:
        return None
    r, w = neg[seen] / pos[seen], weight[seen].double()
    if float(w.min()) <= 0 or float(r.max() / r.min()) < SPREAD:
        return None
    how = {
        "inverse": "the inverse of each label's negative/positive ratio (positives over negatives)",
        "order": "the labels' negative/positive ratios, but in another order than the labels",
    }.get(_missed(w, r) or "")
    if how is None:
        return None
    ids = torch.nonzero(seen).flatten().tolist()
    shown = ", ".join(f"label {i}: negatives/positives {ri:.3g}, pos_weight {wi:.3g}"
                      for i, ri, wi in zip(ids, r.tolist(), w.tolist(), strict=True))  # fmt: skip
    return Finding(
        "class_weight_order", "warning", where,
        f"{calls[0].name}'s pos_weight is {how}: in the {rows} rows of the traced calls "
        f"({shown}) the labels whose positives are rarest get the least positive weight",
        "pos_weight = (rows - positives) / positives for each label, in the labels' order "
        "(positives = train_targets.sum(0)): 300 negatives and 100 positives give 3",
    )  # fmt: skip


def check_class_weights(ctx: Context) -> list[Finding]:
    """class_weight_order: each weighted class-index loss line against its targets' counts,
    and each BCE-with-logits pos_weight against its labels' positives."""
    lines: dict[str, list[LossCall]] = {}
    positive: dict[str, list[LossCall]] = {}
    watch = trace_ok(ctx).watch
    for c in watch.calls:
        if c.weight is not None and c.target is not None and c.weight.dim() == 1:
            lines.setdefault(c.where, []).append(c)
    for c in watch.weighted:
        positive.setdefault(c.where, []).append(c)
    found = [_judged(where, calls) for where, calls in lines.items()]
    found += [_judged_positive(where, calls) for where, calls in positive.items()]
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
