"""Tests for isotrain.compile: bucket lists, bucket lookup, next-token padding collate, and the
same-bucket batch sampler. (The padded-loss equality with a causal model is in test_compile.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from isotrain.compile import BucketBatchSampler, bucket_for, default_buckets, pad_to_bucket


def test_default_buckets_powers_of_two_then_block_size():
    assert default_buckets(256) == (16, 32, 64, 128, 256)
    assert default_buckets(100) == (16, 32, 64, 100)
    assert default_buckets(100, min_len=20) == (32, 64, 100)  # min_len rounds up to 2**k
    assert default_buckets(8) == (8,)
    assert default_buckets(16) == (16,)
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        default_buckets(0)
    with pytest.raises(ValueError, match="min_len must be a positive int"):
        default_buckets(64, min_len=-1)


def test_bucket_for_picks_the_smallest_holding_bucket():
    buckets = (16, 32, 64)
    got = [bucket_for(n, buckets) for n in (0, 1, 16, 17, 32, 33, 64)]
    assert got == [16, 16, 16, 32, 32, 64, 64]
    with pytest.raises(ValueError, match="length 65 exceeds the largest bucket 64"):
        bucket_for(65, buckets)
    with pytest.raises(ValueError, match="strictly increasing"):
        bucket_for(3, (32, 16))
    with pytest.raises(ValueError, match="buckets is empty"):
        bucket_for(3, ())
    with pytest.raises(ValueError, match="length must be a non-negative int"):
        bucket_for(-1, buckets)


def test_pad_to_bucket_shifts_targets_and_marks_padding():
    docs = [torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6])]
    inputs, targets, lengths = pad_to_bucket(docs, buckets=(2, 4, 8), pad_id=9, ignore_index=-1)
    assert inputs.tolist() == [[1, 2, 3, 9], [5, 9, 9, 9]]
    assert targets.tolist() == [[2, 3, 4, -1], [6, -1, -1, -1]]
    assert lengths.tolist() == [3, 1]
    assert inputs.dtype == docs[0].dtype
    # exactly the bucket width when the longest fills it
    inputs, _, _ = pad_to_bucket([torch.arange(5)], buckets=(2, 4, 8))
    assert inputs.shape == (1, 4)


def test_pad_to_bucket_rejects_or_truncates_long_and_bad_sequences():
    long = torch.arange(20)
    with pytest.raises(ValueError, match="length 19 exceeds the largest bucket 8"):
        pad_to_bucket([long], buckets=(4, 8))
    inputs, targets, lengths = pad_to_bucket([long], buckets=(4, 8), truncate=True)
    assert inputs.tolist() == [list(range(8))] and targets.tolist() == [list(range(1, 9))]
    assert lengths.tolist() == [8]
    with pytest.raises(ValueError, match=r"seqs\[1\] must be a 1-D tensor of at least 2"):
        pad_to_bucket([long, torch.tensor([3])], buckets=(32,))
    with pytest.raises(ValueError, match="seqs is empty"):
        pad_to_bucket([], buckets=(32,))


def test_bucket_batch_sampler_groups_by_bucket_with_fixed_batch_size():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 70, (200,), generator=gen).tolist()
    buckets = (16, 32, 64)
    sampler = BucketBatchSampler(lengths, batch_size=4, buckets=buckets, seed=3)
    batches = list(sampler)
    assert len(batches) == len(sampler) > 0
    assert all(len(b) == 4 for b in batches)  # drop_last: one shape per bucket
    flat = [i for b in batches for i in b]
    assert len(flat) == len(set(flat))
    for b in batches:  # every document of a batch pads to the same bucket
        assert len({bucket_for(min(lengths[i] - 1, 64), buckets) for i in b}) == 1
    assert list(sampler) == batches  # a pure function of (seed, epoch)
    sampler.set_epoch(1)
    assert list(sampler) != batches
    keep = BucketBatchSampler(lengths, batch_size=4, buckets=buckets, drop_last=False)
    assert sorted(i for b in keep for i in b) == list(range(200))
    ordered = BucketBatchSampler(lengths, batch_size=4, buckets=buckets, shuffle=False)
    first_bucket = [i for i, n in enumerate(lengths) if n - 1 <= 16]
    assert next(iter(ordered)) == first_bucket[:4]


def test_bucket_batch_sampler_collates_with_pad_to_bucket():
    docs = [torch.arange(n) for n in (3, 30, 5, 40, 9, 33, 12, 50)]
    sampler = BucketBatchSampler([len(d) for d in docs], batch_size=2, buckets=(16, 64))
    widths = {pad_to_bucket([docs[i] for i in b], buckets=(16, 64))[0].shape for b in sampler}
    assert widths == {(2, 16), (2, 64)}
    with pytest.raises(ValueError, match=r"lengths\[1\] = 1: a document needs at least 2"):
        BucketBatchSampler([5, 1], batch_size=2, buckets=(16,))


def test_padding_matches_the_losss_ignore_index_nanogpt_uses_minus_one():
    torch.manual_seed(0)
    docs = [torch.randint(0, 10, (n,)) for n in (9, 5, 3)]
    logits_of = torch.nn.Embedding(10, 10)  # a stand-in causal model: next-token logits per input

    def nanogpt_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # as nanoGPT's model.py
        logits = logits_of(x)
        return F.cross_entropy(logits.view(-1, 10), y.view(-1), ignore_index=-1)

    x, y, lengths = pad_to_bucket(docs, buckets=(4, 8), ignore_index=-1)
    unpadded = torch.cat(
        [F.cross_entropy(logits_of(d[:-1]), d[1:], reduction="none") for d in docs]
    )
    torch.testing.assert_close(nanogpt_loss(x, y), unpadded.mean())
    assert int(lengths.sum()) == unpadded.numel()
    x, y, _ = pad_to_bucket(docs, buckets=(4, 8))  # the default -100 does not match that loss
    with pytest.raises(IndexError, match="Target -100 is out of bounds"):
        nanogpt_loss(x, y)
