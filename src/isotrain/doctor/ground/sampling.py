"""A DataLoader's sampler, drawn from without moving it: the indices of one pass, with the
sampler's attributes and any torch.Generator it holds put back, so the user's epoch draws
what it would have."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

__all__ = ["draw", "epoch_sampler", "index_sampler"]


def epoch_sampler(source: Any) -> Any:
    """The sampler of a DataLoader that shuffles by an epoch it is told (`set_epoch`), else None."""
    if not isinstance(source, DataLoader):
        return None
    inner = getattr(source.batch_sampler, "sampler", None)
    for sampler in (source.sampler, inner):
        if callable(getattr(sampler, "set_epoch", None)) and getattr(sampler, "shuffle", True):
            return sampler
    return None


def index_sampler(source: Any) -> tuple[Any, bool]:
    """What picks a DataLoader's sample indices and whether it yields batches of them: torch's
    BatchSampler's own sampler, else a batch sampler of the user's (a bucketing or sharding
    one: the DataLoader's `sampler` is then unused), else the sampler; (None, False) for an
    IterableDataset or anything but a DataLoader."""
    if not isinstance(source, DataLoader) or isinstance(source.dataset, IterableDataset):
        return None, False
    batches = source.batch_sampler
    if batches is None:
        return source.sampler, False
    if type(batches) is BatchSampler:
        return batches.sampler, False
    return batches, True


def draw(sampler: Any, limit: int) -> list[Any]:
    """The first `limit` items of one pass over `sampler`; its attributes and generators as
    they were (a RandomSampler's generator advances on every pass)."""
    kept = dict(vars(sampler))
    generators = [g for g in kept.values() if isinstance(g, torch.Generator)]
    states = [g.get_state() for g in generators]
    try:
        return list(itertools.islice(iter(sampler), limit))
    finally:
        vars(sampler).update(kept)
        for g, state in zip(generators, states, strict=True):
            g.set_state(state)
