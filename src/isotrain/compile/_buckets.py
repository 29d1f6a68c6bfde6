"""Sequence-length buckets: a few fixed shapes so a compiled model never recompiles.

Variable-length documents give a new tensor shape almost every batch, and every new shape is
a new graph for ``torch.compile``. Padding each batch up to the smallest of a few bucket
lengths bounds the number of shapes (one graph per bucket); the padding is marked with
``ignore_index`` in the targets so it never changes the loss of a causal model.

Example::

    buckets = default_buckets(256)                      # (16, 32, 64, 128, 256)
    inputs, targets, lengths = pad_to_bucket(docs, buckets=buckets)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler

__all__ = ["BucketBatchSampler", "bucket_for", "default_buckets", "pad_to_bucket"]


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def default_buckets(block_size: int, *, min_len: int = 16) -> tuple[int, ...]:
    """Powers of two from ``min_len`` (rounded up to a power of two) below ``block_size``,
    then ``block_size`` itself: ``default_buckets(100) == (16, 32, 64, 100)``.

    Few buckets mean few compiles; padding waste stays under 50% of each batch.

    Example: ``default_buckets(256)  # (16, 32, 64, 128, 256)``
    """
    _check_positive_int("block_size", block_size)
    _check_positive_int("min_len", min_len)
    size = 1 << (min_len - 1).bit_length()  # smallest power of two >= min_len
    buckets = []
    while size < block_size:
        buckets.append(size)
        size *= 2
    buckets.append(block_size)
    return tuple(buckets)


def _check_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    buckets = tuple(buckets)
    if not buckets:
        raise ValueError("buckets is empty: pass e.g. buckets=default_buckets(block_size)")
    for b in buckets:
        _check_positive_int("every bucket", b)
    if any(a >= b for a, b in itertools.pairwise(buckets)):
        raise ValueError(f"buckets must be strictly increasing, got {buckets}: sort them")
    return buckets


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``length`` positions.

    Example: ``bucket_for(17, (16, 32, 64)) == 32``.
    """
    buckets = _check_buckets(buckets)
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length must be a non-negative int, got {length!r}")
    i = bisect.bisect_left(buckets, length)
    if i == len(buckets):
        raise ValueError(
            f"length {length} exceeds the largest bucket {buckets[-1]}: split the sequence "
            f"into chunks of at most {buckets[-1]} positions or add a larger bucket"
        )
    return buckets[i]


def pad_to_bucket(
    seqs: Sequence[torch.Tensor],
    *,
    buckets: Sequence[int],
    pad_id: int = 0,
    ignore_index: int = -100,
    truncate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Collate 1-D token sequences into next-token ``(inputs, targets, lengths)`` of shape
    ``(B, L)``, ``(B, L)``, ``(B,)`` with ``L`` the smallest bucket holding the longest one.

    A sequence of ``n`` tokens gives ``n - 1`` (input, target) positions; padded inputs hold
    ``pad_id`` and padded targets hold ``ignore_index``, so a causal model's loss with the same
    ``ignore_index`` equals the loss on the unpadded sequences: pass your loss's value
    (``F.cross_entropy`` defaults to -100; nanoGPT's model uses -1). ``lengths`` counts real
    positions (use ``lengths.sum()`` for tokens/s). ``truncate=True`` cuts sequences longer
    than the largest bucket instead of raising.

    Example::

        inputs, targets, lengths = pad_to_bucket([doc_a, doc_b], buckets=(16, 32, 64))
    """
    buckets = _check_buckets(buckets)
    if len(seqs) == 0:
        raise ValueError("seqs is empty: pass at least one 1-D tensor of token ids")
    for i, s in enumerate(seqs):
        if not isinstance(s, torch.Tensor) or s.dim() != 1 or s.numel() < 2:
            raise ValueError(
                f"seqs[{i}] must be a 1-D tensor of at least 2 token ids (one input and its "
                f"next-token target), got {getattr(s, 'shape', type(s).__name__)}"
            )
    max_positions = buckets[-1]
    if truncate:
        seqs = [s[: max_positions + 1] for s in seqs]
    lengths = [s.numel() - 1 for s in seqs]
    width = bucket_for(max(lengths), buckets)
    first = seqs[0]
    inputs = torch.full((len(seqs), width), pad_id, dtype=first.dtype, device=first.device)
    targets = torch.full_like(inputs, ignore_index)
    for row, (s, n) in enumerate(zip(seqs, lengths, strict=True)):
        inputs[row, :n] = s[:-1]
        targets[row, :n] = s[1:]
    return inputs, targets, torch.tensor(lengths, device=first.device)


class BucketBatchSampler(Sampler[list[int]]):
    """Batches of dataset indices whose documents fall in the same length bucket.

    ``lengths[i]`` is document *i*'s token count (bucketed as ``pad_to_bucket`` does, by
    ``n - 1`` positions, clamped to the largest bucket). Every batch has exactly
    ``batch_size`` items when ``drop_last=True`` (the default), so each bucket is one
    shape ``(batch_size, bucket)``: a short last batch would be a new shape and a recompile.
    Order is a pure function of ``(seed, epoch)``.

    Example::

        sampler = BucketBatchSampler(doc_lengths, batch_size=8, buckets=default_buckets(256))
        loader = DataLoader(docs, batch_sampler=sampler, collate_fn=partial(
            pad_to_bucket, buckets=sampler.buckets))
    """

    def __init__(
        self,
        lengths: Sequence[int],
        *,
        batch_size: int,
        buckets: Sequence[int],
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        self.batch_size = _check_positive_int("batch_size", batch_size)
        self.buckets = _check_buckets(buckets)
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0
        self._groups: dict[int, list[int]] = {b: [] for b in self.buckets}
        for i, n in enumerate(lengths):
            if int(n) < 2:
                raise ValueError(f"lengths[{i}] = {n}: a document needs at least 2 tokens")
            self._groups[bucket_for(min(int(n) - 1, self.buckets[-1]), self.buckets)].append(i)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose shuffle order ``__iter__`` yields next."""
        self.epoch = epoch

    def _batches_per_group(self, size: int) -> int:
        return size // self.batch_size if self.drop_last else -(-size // self.batch_size)

    def __len__(self) -> int:
        return sum(self._batches_per_group(len(g)) for g in self._groups.values())

    def __iter__(self) -> Iterator[list[int]]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        batches: list[list[int]] = []
        for group in self._groups.values():
            if self.shuffle:
                group = [group[i] for i in torch.randperm(len(group), generator=gen).tolist()]
            n = self._batches_per_group(len(group))
            batches.extend(group[k * self.batch_size : (k + 1) * self.batch_size] for k in range(n))
        order = torch.randperm(len(batches), generator=gen).tolist() if self.shuffle else None
        yield from (batches[i] for i in order) if order is not None else batches
