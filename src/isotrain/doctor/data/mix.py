"""batch_class_mix: every batch holds one class while the dataset holds several.

A DataLoader with shuffle off reads a dataset in its stored order; stored by class (an
ImageFolder, a CSV sorted by label), each step then trains on one class and the model follows
the latest one. Read from the class targets of the loss calls of the user's step, against
labels read across the whole dataset (in a worker: `draw`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import SequentialSampler

from isotrain.doctor.data.draw import Path, at, draw, leaves, map_style
from isotrain.doctor.ground.context import Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ground.trace import trace_ok

__all__ = ["MIX", "check_class_mix"]

_SPREAD = 16  # samples read across the dataset
_MIN_RUN = 2  # a class seen fewer times than this across it says nothing of the order


def _label_path(batch: Any, target: torch.Tensor) -> Path | None:
    """Where in the batch the loss's class targets came from: the integer field equal to them."""
    flat = target.reshape(-1).cpu()
    for path, field in leaves(batch):
        same = not field.is_floating_point() and field.numel() == flat.numel()
        if same and torch.equal(field.reshape(-1).cpu().long(), flat.long()):
            return path
    return None


def _batch_classes(ctx: Context) -> tuple[list[list[int]], Path | None]:
    """The classes of each traced batch's targets (ignore index left out; a batch with fewer
    than 2 targets says nothing), one loss call per batch, and where batch 0 holds them."""
    calls = [c for c in trace_ok(ctx).watch.calls if c.target is not None]
    first = {c.step: c for c in reversed(calls) if c.step < len(ctx.batches)}
    classes, path = [], None
    for step, call in sorted(first.items()):
        t = call.target
        if t is None or t.numel() < 2:
            return [], None
        classes.append(sorted(set(t[t != call.ignore_index].tolist())))
        if step == 0:
            path = _label_path(ctx.batches[0], t)
    return classes, path


def _runs(labels: list[int]) -> bool:
    """Whether each class of `labels` sits in one run, with at least two classes seen twice."""
    starts = [lab for i, lab in enumerate(labels) if i == 0 or labels[i - 1] != lab]
    seen = [lab for lab in set(labels) if labels.count(lab) >= _MIN_RUN]
    return len(starts) == len(set(starts)) and len(seen) >= 2


def check_class_mix(ctx: Context) -> list[Finding]:
    """A loader in stored order whose batches each hold one class of a dataset sorted by class."""
    loader = map_style(ctx.source)
    if loader is None or not isinstance(loader.sampler, SequentialSampler):
        return []  # shuffled, or a sampler of the user's: its order is theirs to choose
    classes, path = _batch_classes(ctx)
    if len(classes) < 2 or path is None or any(len(c) != 1 for c in classes):
        return []
    n = len(loader.dataset)  # type: ignore[arg-type]
    indices = sorted({round(i * (n - 1) / (_SPREAD - 1)) for i in range(_SPREAD)})
    labels = [int(torch.as_tensor(at(b, path)).reshape(-1)[0]) for b in draw(loader, indices)]
    if not _runs(labels):
        return []
    shown = ", ".join(str(c[0]) for c in classes)
    return [Finding(
        "batch_class_mix", "warning", "your DataLoader (shuffle=False)",
        f"each of the first {len(classes)} batches holds a single class ({shown}), while "
        f"{len(indices)} samples read across the dataset's {n} hold classes "
        f"{sorted(set(labels))}, each in one run ({labels[:8]}...): the DataLoader reads the "
        "dataset in its stored order (shuffle=False), sorted by class, so every step trains "
        "on one class and the model follows the latest",
        "shuffle the training data: DataLoader(dataset, shuffle=True) (or a RandomSampler / "
        "DistributedSampler(shuffle=True)); keep shuffle=False for evaluation only",
    )]  # fmt: skip


MIX = Check(
    "batch_class_mix",
    (
        Kind(
            "batch_class_mix",
            "every batch holds one class of a dataset sorted by class (shuffle off)",
        ),
    ),
    check_class_mix,
)
