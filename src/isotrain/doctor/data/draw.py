"""Reading the user's own dataset without changing it: samples drawn in a worker process.

A dataset's `__getitem__` may advance a generator it holds, fill a cache or count reads; a
probe DataLoader over the same dataset draws in a worker (a copy), with its own base seed
(the global RNG is not drawn from), and with the user's collate_fn, so what comes back is
built like the user's batches: one sample per batch.
"""

from __future__ import annotations

import inspect
import multiprocessing
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from isotrain.doctor.ground.context import CannotRun

__all__ = ["Path", "at", "draw", "getitem_at", "leaves", "map_style"]

Path = tuple[Any, ...]  # keys and indices from a batch down to one of its tensors
_TIMEOUT_S = 60.0


def map_style(source: Any) -> DataLoader[Any] | None:
    """The user's DataLoader when they passed one over a map-style, non-empty dataset."""
    if not isinstance(source, DataLoader) or isinstance(source.dataset, IterableDataset):
        return None
    try:
        return source if len(source.dataset) > 0 else None  # type: ignore[arg-type]
    except TypeError:  # a dataset without __len__
        return None


def leaves(batch: Any, path: Path = ()) -> list[tuple[Path, torch.Tensor]]:
    """Every tensor in a batch (nested tuples, lists and dicts) with its path."""
    if isinstance(batch, torch.Tensor):
        return [(path, batch)]
    if isinstance(batch, dict):
        return [x for k, v in batch.items() for x in leaves(v, (*path, k))]
    if isinstance(batch, (tuple, list)):
        return [x for i, v in enumerate(batch) for x in leaves(v, (*path, i))]
    return []


def at(batch: Any, path: Path) -> Any:
    """The part of `batch` at `path`."""
    for key in path:
        batch = batch[key]
    return batch


def draw(loader: DataLoader[Any], indices: Sequence[int], *, seed: int = 0) -> list[Any]:
    """The user's dataset read at `indices` in one worker process (its base seed from `seed`),
    each sample collated alone by the user's collate_fn; CannotRun when the worker cannot
    read it."""
    context = loader.multiprocessing_context
    if context is None and "fork" in multiprocessing.get_all_start_methods():
        context = "fork"  # a copy of the dataset as it is, nothing pickled
    probe = DataLoader(
        loader.dataset, batch_size=1, sampler=list(indices), num_workers=1,
        collate_fn=loader.collate_fn, worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=context, generator=torch.Generator().manual_seed(seed),
        timeout=_TIMEOUT_S,
    )  # fmt: skip
    try:
        return list(probe)
    except Exception as e:
        raise CannotRun(
            f"the dataset could not be read in a worker process ({type(e).__name__}: {str(e)[:80]})"
        ) from e


def getitem_at(dataset: Any) -> str:
    """`file:line (Class.__getitem__)` of the dataset's __getitem__, or its class name."""
    try:
        fn = type(dataset).__getitem__
        path = inspect.getsourcefile(fn) or "?"
        rel = os.path.relpath(path)
        path = path if rel.startswith("..") else rel
        return f"{path}:{inspect.getsourcelines(fn)[1]} ({type(dataset).__name__}.__getitem__)"
    except (OSError, TypeError):
        return type(dataset).__name__
