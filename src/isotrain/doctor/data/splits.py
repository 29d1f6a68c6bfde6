"""The training split against the evaluation split: samples of the eval loader that are also in
the training loader (train_val_overlap), and random augmentation applied to evaluation data
(eval_augmented, a train transform shared with the validation split).

The training loader is `batches` (a DataLoader); the evaluation loaders are the DataLoaders
your eval_fn reads by name (a global, a closure cell, a functools.partial argument). Splits of
one dataset object are compared by their indices into it; other datasets by a hash of each
raw row (a TensorDataset's tensors, a `.data` array), read in place, no transform run.
"""

from __future__ import annotations

import functools
import hashlib
import types
from typing import Any

import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

from isotrain.doctor.data.draw import draw, leaves, map_style
from isotrain.doctor.ground.context import CannotRun, Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.globals import cell_full
from isotrain.doctor.ground.kinds import Check, Kind

__all__ = ["SPLITS", "check_splits", "eval_loaders"]

MAX_ROWS = 200_000  # rows hashed per split at most
_SHARE = 0.01  # an overlap of this fraction of the eval split is an error (else: duplicates)
_READS = 4  # eval samples each read twice under two seeds


def eval_loaders(ctx: Context) -> list[DataLoader[Any]]:
    """The DataLoaders the user's eval_fn reads by name, other than the training loader."""
    found: dict[int, DataLoader[Any]] = {}
    todo: list[Any] = [ctx.eval_fn]
    seen: set[int] = set()
    while todo:
        f = todo.pop()
        if id(f) in seen or f is None:
            continue
        seen.add(id(f))
        if isinstance(f, functools.partial):
            values = [*f.args, *f.keywords.values(), f.func]
        elif isinstance(f, types.FunctionType):
            cells = [c.cell_contents for c in f.__closure__ or () if cell_full(c)]
            names = [f.__globals__[n] for n in f.__code__.co_names if n in f.__globals__]
            values = [*cells, *names]
        else:
            continue
        for v in values:
            if isinstance(v, DataLoader) and v is not ctx.source:
                found[id(v)] = v
            elif isinstance(v, (types.FunctionType, functools.partial)):
                todo.append(v)
    return list(found.values())


def _root(dataset: Any) -> tuple[Any, list[int]]:
    """The dataset under any Subsets, and the indices into it this one reads."""
    indices = list(range(len(dataset)))
    while isinstance(dataset, Subset):
        indices = [int(dataset.indices[i]) for i in indices]
        dataset = dataset.dataset
    return dataset, indices


def _raw_rows(dataset: Any) -> Any:
    """The dataset's raw inputs, indexable by row, or None (a TensorDataset's first tensor, a
    torchvision-style `.data` with a row per sample)."""
    if isinstance(dataset, TensorDataset):
        return dataset.tensors[0]
    data: Any = getattr(dataset, "data", None)
    arrays = isinstance(data, torch.Tensor) or hasattr(data, "tobytes")  # a tensor, an ndarray
    return data if arrays and hasattr(data, "shape") and len(data) == len(dataset) else None


def _hashes(rows: Any, indices: list[int]) -> dict[bytes, int]:
    """{hash of a row: its index} over up to MAX_ROWS rows."""
    out = {}
    for i in indices[:MAX_ROWS]:
        row = rows[i]
        row = row.detach().cpu().contiguous().numpy() if isinstance(row, torch.Tensor) else row
        out[hashlib.blake2b(row.tobytes(), digest_size=16).digest()] = i  # C order
    return out


def _overlap(train: Any, val: Any) -> tuple[int, int, str] | None:
    """(eval samples also in training, eval samples compared, how) or None if not comparable."""
    (troot, tidx), (vroot, vidx) = _root(train), _root(val)
    if troot is vroot:
        return len(set(tidx) & set(vidx)), len(vidx), "the same indices of one dataset"
    trows, vrows = _raw_rows(troot), _raw_rows(vroot)
    if trows is None or vrows is None:
        return None
    th, vh = _hashes(trows, tidx), _hashes(vrows, vidx)
    return len(th.keys() & vh.keys()), len(vh), "identical raw rows"


def check_splits(ctx: Context) -> list[Finding]:
    """train_val_overlap and eval_augmented, for each eval DataLoader your eval_fn reads."""
    train = map_style(ctx.source)
    if train is None:
        return []  # batches of the user's own making: no split to compare (as mix, pairs)
    loaders = [v for v in eval_loaders(ctx) if map_style(v) is not None]
    if not loaders and not {"train_val_overlap", "eval_augmented"} & ctx.asked:
        return []  # most eval_fns read the batches examine hands them: said only when asked
    if not loaders:
        raise CannotRun(
            "no eval DataLoader found: pass eval_fn that reads your validation DataLoader by "
            "name (e.g. eval_fn=lambda model, _: evaluate(model, val_loader))"
        )
    out = []
    for val in loaders:
        out += _overlap_finding(train, val) + _augmented(train, val)
    return out


def _overlap_finding(train: DataLoader[Any], val: DataLoader[Any]) -> list[Finding]:
    found = _overlap(train.dataset, val.dataset)
    if found is None or found[0] == 0:
        return []
    shared, total, how = found
    error = shared >= max(1, _SHARE * total) or how.startswith("the same indices")
    return [Finding(
        "train_val_overlap", "error" if error else "info", "your eval DataLoader",
        f"{shared} of {total} samples of the eval loader are also in the training loader "
        f"({how}): the validation metric measures samples the model trained on",
        "split once, into disjoint index sets (one random_split with a seeded generator, or a "
        "split of the indices before any shuffle), and build both loaders from that split"
        if error else "the data holds duplicate rows: deduplicate before splitting",
    )]  # fmt: skip


def _augmented(train: DataLoader[Any], val: DataLoader[Any]) -> list[Finding]:
    """eval_augmented: the same eval samples read under two seeds differ."""
    n = len(val.dataset)  # type: ignore[arg-type]
    indices = list(range(min(_READS, n)))
    a, b = draw(val, indices, seed=0), draw(val, indices, seed=1)
    differ = [i for i, x, y in zip(indices, a, b, strict=True) if not _same(x, y)]
    if not differ:
        return []
    vroot, troot = _root(val.dataset)[0], _root(train.dataset)[0]
    tf = getattr(vroot, "transform", None)
    shared = vroot is troot or (tf is not None and tf is getattr(troot, "transform", None))
    cause = (
        "; its transform is the training split's own object (one dataset, or one transform, "
        "behind both loaders)"
        if shared
        else ""
    )
    return [Finding(
        "eval_augmented", "warning", "your eval DataLoader",
        f"{len(differ)} of {len(indices)} eval samples read twice under two seeds came back "
        f"different: random augmentation applies to evaluation data{cause}",
        "give the eval split its own deterministic transform: build the dataset twice "
        "(train_tf, eval_tf) and split the indices once, or wrap the eval Subset in a dataset "
        "that applies eval_tf",
    )]  # fmt: skip


def _same(x: Any, y: Any) -> bool:
    lx, ly = leaves(x), leaves(y)
    return len(lx) == len(ly) and all(
        a.shape == b.shape and torch.equal(a, b) for (_, a), (_, b) in zip(lx, ly, strict=True)
    )


SPLITS = Check(
    "splits",
    (
        Kind("train_val_overlap", "samples of the eval loader are also in the training loader"),
        Kind("eval_augmented", "random augmentation applies to evaluation data"),
    ),
    check_splits,
)
