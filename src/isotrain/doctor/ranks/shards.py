"""data_split_across_ranks: one epoch of every rank's sampler, compared across ranks.

Data parallel means each rank trains on its own part of the data: over an epoch the ranks'
samples are disjoint and together cover the dataset (a DistributedSampler pads or drops at
most world_size - 1 to even them out). Each rank draws one pass of its DataLoader's sampler
(put back as it was: ground.sampling) and sends a bitmap of the indices it drew; a sampler
that repeats an index within one rank (drawing with replacement) is not judged. Indices are
compared only when every rank holds the same dataset (its length and a few samples, drawn
under one seed, hash alike): ranks that read their own files are split by design.
"""

from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass
from typing import Any

import torch

from isotrain._torch_private import tree_leaves
from isotrain.contexts import rng_isolated
from isotrain.doctor.ground.context import CannotRun, Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ground.sampling import draw, index_sampler
from isotrain.doctor.ranks.link import Ranks

__all__ = ["SHARDS", "check_shards"]

LIMIT = 1 << 22  # samples in a dataset whose epoch is drawn and compared
_SETTINGS = ("num_replicas", "rank", "seed", "epoch")


@dataclass(frozen=True)
class _Epoch:
    """One rank's epoch: the dataset's fingerprint, what it drew, its sampler's settings."""

    dataset: tuple[int, str]
    sampler: str
    drawn: int
    repeats: bool
    bits: bytes
    settings: tuple[Any, ...]


def check_shards(ctx: Context) -> list[Finding]:
    """data_split_across_ranks: the ranks' epochs overlap, or together miss part of the data."""
    ranks: Ranks | None = ctx.ranks
    if ranks is None:
        raise CannotRun("needs a process group of 2 or more ranks (torchrun --nproc-per-node N)")
    (sampler, batched), why = _sampler(ctx.source)
    try:
        mine: _Epoch | str = why or _epoch(ctx.source.dataset, sampler, batched=batched)
    except CannotRun as e:
        mine = str(e)
    got = ranks.gather("each rank's epoch of samples", mine)
    reason = next((f"on rank {r}: {g}" for r, g in enumerate(got) if isinstance(g, str)), None)
    if reason is not None:  # on every rank: they all take the same path from here
        raise CannotRun(got[ranks.rank] if isinstance(got[ranks.rank], str) else reason)
    epochs: list[_Epoch] = got
    if ctx.cache.get("same data on ranks") or len({e.dataset for e in epochs}) > 1:
        return []  # byte-identical batches are said once; ranks with their own data split by design
    if any(e.repeats for e in epochs):
        return []  # drawn with replacement: samples may repeat on any rank by design
    return _judge(epochs, ranks.world)


def _sampler(source: Any) -> tuple[tuple[Any, bool], str | None]:
    """What draws `source`'s indices (and whether in batches), or why nothing can be drawn."""
    sampler, batched = index_sampler(source)
    if sampler is None:
        return (None, False), (
            "needs your DataLoader as batches= (a map-style dataset): a list of batches does "
            "not show how each rank's epoch is drawn"
        )
    try:
        n = len(source.dataset)
    except TypeError:
        return (None, False), "your DataLoader's dataset has no len()"
    if n > LIMIT:
        return (None, False), f"the dataset holds {n} samples, more than the {LIMIT} compared"
    return (sampler, batched), None


def _fingerprint(dataset: Any) -> tuple[int, str]:
    """(length, sha1 of the first, middle and last samples' contents, drawn under seed 0)."""
    n, h, seen = len(dataset), hashlib.sha1(), 0
    # a random augmentation draws alike on every rank; no CUDA device is touched (capturing
    # every device's RNG would start a context on each, from every rank)
    with rng_isolated(seed=0, devices=()):
        for i in sorted({0, n // 2, n - 1} if n else set()):
            for leaf in tree_leaves(dataset[i]):
                if isinstance(leaf, torch.Tensor):
                    c = leaf.detach().cpu().contiguous().reshape(-1)
                    h.update(c.view(torch.uint8).numpy().tobytes() if c.numel() else b"")
                elif isinstance(leaf, (int, float, str, bytes)):
                    h.update(repr(leaf).encode())
                else:
                    continue
                seen += 1
    if n and not seen:
        raise CannotRun("your dataset's samples hold no tensors or numbers to compare by rank")
    return n, h.hexdigest()[:12]


def _epoch(dataset: Any, sampler: Any, *, batched: bool) -> _Epoch:
    """This rank's epoch: every index its sampler (or batch sampler) draws in one pass, as a
    bitmap."""
    n = len(dataset)
    drawn = draw(sampler, 2 * LIMIT)
    try:
        flat = [i for batch in drawn for i in batch] if batched else drawn
        taken = torch.tensor([operator.index(i) for i in flat], dtype=torch.int64)
    except TypeError:
        taken = torch.full((1,), -1)
    if taken.numel() and not 0 <= int(taken.min()) <= int(taken.max()) < n:
        raise CannotRun(f"your {type(sampler).__name__} yields keys, not indices below {n}")
    bits = torch.zeros(n + (-n) % 8, dtype=torch.bool)
    bits[taken] = True
    repeats = int(bits.sum()) < taken.numel()
    packed = (bits.view(-1, 8).to(torch.uint8) << torch.arange(8, dtype=torch.uint8)).sum(1)
    settings = tuple(getattr(sampler, s, None) for s in _SETTINGS)
    return _Epoch(
        _fingerprint(dataset), type(sampler).__name__, taken.numel(), repeats,
        packed.to(torch.uint8).numpy().tobytes(), settings,
    )  # fmt: skip


def _unpack(bits: bytes, n: int) -> torch.Tensor:
    packed = torch.frombuffer(bytearray(bits), dtype=torch.uint8)
    return ((packed[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(-1)[:n]


def _judge(epochs: list[_Epoch], world: int) -> list[Finding]:
    """The finding, the same on every rank: samples drawn by several ranks, samples none drew."""
    n = epochs[0].dataset[0]
    counts = torch.stack([_unpack(e.bits, n).to(torch.int64) for e in epochs]).sum(0)
    covered = int((counts > 0).sum())
    extra = sum(e.drawn for e in epochs) - covered
    partitions = all(e.settings[0] is not None for e in epochs)  # a DistributedSampler's kind
    missed = n - covered if partitions else 0
    if extra < world and missed < world:  # padding or drop_last evens out at most world - 1
        return []
    seen = []
    if extra >= world:
        seen.append(f"{extra} of the draws repeat a sample another rank drew")
    if missed >= world:
        seen.append(f"{missed} samples no rank drew")
    cause, fix = _cause(epochs, world)
    kind = epochs[0].sampler
    return [Finding(
        "data_split_across_ranks", "error", kind,
        f"over one epoch of your DataLoader's {kind} ({n} samples; {world} ranks drawing "
        f"{', '.join(str(e.drawn) for e in epochs)}), {' and '.join(seen)}: the ranks do not "
        f"split the data between them; {cause}",
        fix,
    )]  # fmt: skip


def _cause(epochs: list[_Epoch], world: int) -> tuple[str, str]:
    """Why the split is wrong, read from the samplers' settings, and the fix for that cause."""
    replicas, ranks, seeds, when = (list(s) for s in zip(*(e.settings for e in epochs)))
    split = "DistributedSampler(dataset) on every rank, its seed the same everywhere"
    if replicas[0] is None:
        return (
            f"each rank's {epochs[0].sampler} draws from the whole dataset (no DistributedSampler)",
            f"DataLoader(dataset, sampler={split}) with sampler.set_epoch(epoch) each epoch",
        )
    if any(r != world for r in replicas) or sorted(ranks) != list(range(world)):
        shown = "; ".join(f"rank {r}: num_replicas={m}, rank={k}"
                          for r, (m, k) in enumerate(zip(replicas, ranks)))  # fmt: skip
        return (
            f"the samplers are told another world ({shown}) than the process group's {world} ranks",
            "leave num_replicas and rank to DistributedSampler (it reads the process group), or "
            "pass dist.get_world_size() and dist.get_rank() (not a local rank or a GPU count)",
        )
    if len(set(seeds)) > 1:
        shown = ", ".join(f"{s} on rank {r}" for r, s in enumerate(seeds))
        return (
            f"the sampler's seed differs by rank ({shown}): each rank takes its slice of "
            "another permutation",
            "give DistributedSampler one seed on every rank (seed=args.seed, not a per-rank "
            "seed); seed augmentations per rank elsewhere",
        )
    if len(set(when)) > 1:
        shown = ", ".join(f"{e} on rank {r}" for r, e in enumerate(when))
        return (
            f"the sampler's epoch differs by rank ({shown}): set_epoch was called with other "
            "epochs, or on some ranks only",
            "call sampler.set_epoch(epoch) on every rank with the same epoch, before iterating",
        )
    return (
        "the samplers' settings agree across ranks, so the sampler itself does not split",
        f"use {split}, or make your sampler give each rank a disjoint part",
    )


SHARDS = Check(
    "data_split",
    (
        Kind(
            "data_split_across_ranks",
            "over one epoch of the DataLoader's sampler, ranks draw the same samples or together "
            "miss part of the dataset (per-rank seeds or epochs, wrong num_replicas/rank, no "
            "DistributedSampler)",
        ),
    ),
    check_shards,
    ranks=True,
)
