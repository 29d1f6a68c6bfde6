"""The corpus as token arrays, the step-indexed batch sampler, and the baseline to beat.

The default corpus is the running interpreter's own standard-library `.py` sources, so
training needs no download anywhere (`sources.py` finds data of every other form). Batch k
on rank r is a pure function of (seed, step, micro-step, rank): a resumed run draws exactly
the batches it would have drawn.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from isotrain.compile import pad_to_bucket
from isotrain.train.data.sources import DataError, TextData, TokenData, open_data
from isotrain.train.data.tokenizer import ByteTokenizer, IdsTokenizer, Tokenizer, text_chunks

__all__ = [
    "ByteTokenizer",
    "Corpus",
    "DataError",
    "bits_per_byte",
    "build_corpus",
    "document_starts",
    "eval_windows",
    "get_batch",
    "get_doc_batch",
    "load_corpus",
    "require_length",
    "token_dtype",
    "unigram_entropy",
]

log = logging.getLogger(__name__)
TRAIN, VAL = 0, 1  # stream ids: train and val batches never share a random stream
CHUNK = 1 << 24  # tokens per pass over a (possibly memory-mapped) array
BASELINE_TOKENS = 1 << 27  # the unigram baseline is fitted on at most this many tokens


@dataclass(frozen=True)
class Corpus:
    """Train and validation token arrays (possibly memory-mapped) and where they came from.

    `val_bytes` is the UTF-8 size of the text behind `val` (None when unknown): with it a
    loss per token becomes bits per byte, comparable across tokenizers.
    """

    train: np.ndarray
    val: np.ndarray
    source: str
    vocab_size: int
    val_bytes: int | None = None

    def describe(self) -> str:
        """One line for the run header."""
        line = f"{self.source}: {len(self.train):,} train / {len(self.val):,} val tokens"
        if self.val_bytes and len(self.val):
            line += f" ({self.val_bytes / len(self.val):.2f} bytes per token)"
        return line


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest of uint16 / uint32 that holds every id (nanoGPT's .bin files are uint16)."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _max_id(arr: np.ndarray) -> int:
    return max((int(arr[i : i + CHUNK].max()) for i in range(0, len(arr), CHUNK)), default=0)


def _check_vocab(top: int, vocab_size: int, where: str) -> None:
    """Refuse token ids outside the model's vocabulary, naming the flag value that fits."""
    if top >= vocab_size:
        raise DataError(
            f"{where}: token id {top} >= vocabulary size {vocab_size}; "
            f"pass --model.vocab-size {top + 1} (or larger)"
        )


def _encode_text(raw: bytes, tok: Tokenizer, what: str) -> np.ndarray:
    """Token ids of UTF-8 text (bytes tokenizer: the bytes themselves, no copy)."""
    if tok.kind == "bytes":
        return np.frombuffer(raw, dtype=np.uint8)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        log.warning("%s: not valid UTF-8; undecodable bytes became U+FFFD", what)
    dtype = token_dtype(tok.vocab_size)
    ids = tok.encode_many(list(text_chunks(text)))
    return np.concatenate([np.asarray(piece, dtype=dtype) for piece in ids] or [np.zeros(0, dtype)])


def _array_bytes(arr: np.ndarray, lengths: np.ndarray | None) -> int | None:
    """UTF-8 bytes behind `arr` from per-token lengths (chunked: arrays may be memory-mapped)."""
    if lengths is None:
        return None
    return sum(int(lengths[arr[i : i + CHUNK]].sum()) for i in range(0, len(arr), CHUNK))


def _val_bytes(data: TokenData, lengths: np.ndarray | None) -> int | None:
    """Bytes of text behind the val tokens: meta.json's record when it can be true (at least
    one byte, at most the longest token's bytes per token), else counted from the tokens."""
    claimed = data.val_bytes
    if claimed is None:
        return _array_bytes(data.val, lengths)
    longest = int(lengths.max()) if lengths is not None and len(lengths) else None
    if claimed < 1 or (longest is not None and claimed > len(data.val) * longest):
        raise DataError(
            f"{data.source}: meta.json says the val tokens stand for {claimed} bytes of text, "
            f"which {len(data.val)} tokens cannot; run isotrain prepare again"
        )
    return claimed


def build_corpus(data: TextData | TokenData, tok: Tokenizer, vocab_size: int) -> Corpus:
    """Token arrays of `data` through `tok`, every id checked against `vocab_size`."""
    if tok.vocab_size > vocab_size:
        raise DataError(
            f"the tokenizer has {tok.vocab_size} tokens but the model {vocab_size}; "
            f"pass --model.vocab-size {tok.vocab_size}"
        )
    if isinstance(data, TextData):
        if tok.kind == "ids":
            raise DataError(
                f"{data.source} is text: tokenize it, --tokenizer ids is for token files"
            )
        train = _encode_text(data.train, tok, data.source)
        val = _encode_text(data.val, tok, data.source)
        return Corpus(train, val, data.source, tok.vocab_size, len(data.val))
    if data.meta is not None:
        _check_vocab(data.meta.vocab_size - 1, vocab_size, f"{data.meta.folder}/meta.json")
    if len(data.train) > 1 << 30:
        log.info("%s: checking every token id once", data.source)
    top = max(_max_id(data.train), _max_id(data.val))  # the data, not what meta.json claims
    _check_vocab(top, vocab_size, data.source)
    if data.meta is not None and top >= data.meta.vocab_size:
        raise DataError(
            f"{data.source}: token id {top}, but its meta.json records {data.meta.vocab_size} "
            "tokens; the files do not match their meta.json: run isotrain prepare again"
        )
    if tok.kind != "ids" and top >= tok.vocab_size:
        raise DataError(
            f"{data.source}: token id {top} but the tokenizer has {tok.vocab_size} tokens; "
            "these ids come from another tokenizer: pass --tokenizer PATH/tokenizer.json"
        )
    val_bytes = _val_bytes(data, tok.byte_lengths())
    ids = data.meta.vocab_size if data.meta is not None else vocab_size
    return Corpus(data.train, data.val, data.source, ids, val_bytes)


def load_corpus(
    path: str | None,
    *,
    max_bytes: int,
    val_fraction: float,
    vocab_size: int = 256,
    bin_dtype: str = "uint16",
    val_path: str | None = None,
    tokenizer: Tokenizer | None = None,
) -> Corpus:
    """Load the corpus named by `--data.path` (None: the stdlib sources) as token arrays.

    Text is tokenized by `tokenizer` (default: bytes); token files are used as they are
    (default: ids of unknown text).
    """
    data = open_data(
        path, val_path=val_path, max_bytes=max_bytes, val_fraction=val_fraction, bin_dtype=bin_dtype
    )
    if tokenizer is None:
        tokenizer = ByteTokenizer() if isinstance(data, TextData) else IdsTokenizer(vocab_size)
    return build_corpus(data, tokenizer, vocab_size)


def require_length(corpus: Corpus, block_size: int, world_size: int = 1) -> None:
    """Each rank's share of each split must hold at least one block plus its target."""
    for name, arr in (("train", corpus.train), ("val", corpus.val)):
        have = len(arr) // world_size
        if have < block_size + 1:
            raise DataError(
                f"the {name} split of {corpus.source} has {have} tokens per rank, fewer than "
                f"one block ({block_size} + 1); use more data or a smaller --model.block-size"
            )


def get_batch(
    tokens: np.ndarray,
    *,
    batch_size: int,
    block_size: int,
    seed: int,
    step: int,
    micro: int = 0,
    rank: int = 0,
    world_size: int = 1,
    stream: int = TRAIN,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets (B, T) int64, a pure function of the arguments.

    Rank r draws windows only from its own contiguous 1/world_size shard, so ranks never
    share a window start.
    """
    shard = len(tokens) // world_size
    lo = rank * shard
    rng = np.random.default_rng([seed, stream, step, micro, rank])
    starts = lo + rng.integers(0, shard - block_size, size=batch_size)
    idx = starts[:, None] + np.arange(block_size + 1)  # (B, T + 1)
    window = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
    return window[:, :-1], window[:, 1:]


# NOTE [evaluation windows]: the loss of a trained tiny-preset model varies from one 16-window
# batch of the default corpus to the next with a standard deviation of 0.10 nats, so a mean over
# n random batches moves by about 0.10 / sqrt(n): 0.03 at 8 batches, 0.007 at 200 (measured in
# docs/benchmarks.md). Its third decimal would take ~40,000 batches, more than the split holds.
# Every non-overlapping window of the split once has no sampling error at all: the split's exact
# loss, for every seed the same windows, in ~200 batches for the default corpus. A larger split
# is covered by evenly spread windows, up to the batch budget.
def eval_windows(
    tokens: np.ndarray,
    *,
    batch_size: int,
    block_size: int,
    max_batches: int,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Validation batches (B, T): every non-overlapping window of this rank's shard once, or,
    where that takes more than `max_batches` batches, that many of windows spread evenly."""
    shard = len(tokens) // world_size
    total = (shard - 1) // block_size  # windows of T inputs + 1 target that do not overlap
    n = min(total, max_batches * batch_size)
    picks = np.arange(n) * total // n  # all of them when n == total
    for i in range(0, n, batch_size):
        starts = rank * shard + picks[i : i + batch_size] * block_size
        idx = starts[:, None] + np.arange(block_size + 1)  # (B, T + 1)
        window = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
        yield window[:, :-1], window[:, 1:]


def document_starts(tokens: np.ndarray, *, min_len: int = 8) -> np.ndarray:
    """Start offsets of the documents of a byte corpus: text between blank lines ("\\n\\n").

    For Python sources these are functions, classes and import blocks: natural lengths from a
    few bytes to thousands. Documents shorter than `min_len` are dropped.
    """
    arr = np.asarray(tokens)
    breaks = np.flatnonzero((arr[:-1] == 10) & (arr[1:] == 10)) + 2  # first byte after "\n\n"
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(arr)]])
    return starts[ends - starts >= min_len]


def get_doc_batch(
    tokens: np.ndarray,
    starts: np.ndarray,
    *,
    batch_size: int,
    buckets: tuple[int, ...],
    seed: int,
    step: int,
    micro: int = 0,
    rank: int = 0,
    world_size: int = 1,
    stream: int = TRAIN,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Variable-length mode: whole documents padded to the smallest bucket that holds them.

    Returns inputs and targets (B, L) with L a bucket (padding targets are -100, so the loss
    ignores them), and the number of real target tokens. A pure function of its arguments.
    """
    shard = len(starts) // world_size
    rng = np.random.default_rng([seed, stream, step, micro, rank])
    picks = rank * shard + rng.integers(0, shard, size=batch_size)
    ends = np.append(starts[1:], len(tokens))
    docs = [
        torch.from_numpy(np.asarray(tokens[a : min(b, a + buckets[-1] + 1)], dtype=np.int64))
        for a, b in zip(starts[picks], ends[picks], strict=True)
    ]
    x, y, lengths = pad_to_bucket(docs, buckets=buckets)
    return x, y, int(lengths.sum())


def _counts(arr: np.ndarray, vocab_size: int) -> np.ndarray:
    n = min(len(arr), BASELINE_TOKENS)
    out = np.zeros(vocab_size, dtype=np.float64)
    for i in range(0, n, CHUNK):
        out += np.bincount(arr[i : min(i + CHUNK, n)], minlength=vocab_size)[:vocab_size]
    return out


def unigram_entropy(corpus: Corpus) -> float:
    """Cross-entropy (nats/token) on val of a unigram model fitted on train: the baseline.

    Counted over at most the first `BASELINE_TOKENS` tokens of each split.
    """
    counts = _counts(corpus.train, corpus.vocab_size) + 1.0
    logp = np.log(counts / counts.sum())
    val_counts = _counts(corpus.val, corpus.vocab_size)
    return float(-(val_counts * logp).sum() / max(val_counts.sum(), 1))


def bits_per_byte(nats_per_token: float, corpus: Corpus) -> float | None:
    """A loss per token on `corpus.val` in bits per byte of text (None: bytes unknown)."""
    if not corpus.val_bytes:
        return None
    return nats_per_token * len(corpus.val) / corpus.val_bytes / math.log(2)
