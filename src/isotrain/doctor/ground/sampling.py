"""A DataLoader's sampler, drawn from without moving it: the indices of one pass, with the
sampler's attributes and any torch.Generator it holds put back, so the user's epoch draws
what it would have."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.utils.data import DataLoader

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


def index_sampler(source: Any) -> Any:
    """The sampler that picks a DataLoader's sample indices (the batch sampler's own, if it
    has one), else None: an IterableDataset has none."""
    if not isinstance(source, DataLoader) or source.batch_sampler is None:
        return None
    inner = getattr(source.batch_sampler, "sampler", None)
    return inner if inner is not None else source.sampler


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
