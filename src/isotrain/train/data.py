"""Corpus discovery, the byte tokenizer, and a step-indexed batch sampler.

The default corpus is the running interpreter's own standard-library `.py` sources, so
training needs no download anywhere. Batch k on rank r is a pure function of
(seed, step, micro-step, rank): a resumed run draws exactly the batches it would have drawn.
"""

from __future__ import annotations

import functools
import logging
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from isotrain.compile import pad_to_bucket

__all__ = [
    "ByteTokenizer",
    "Corpus",
    "DataError",
    "document_starts",
    "get_batch",
    "get_doc_batch",
    "load_corpus",
    "require_length",
    "unigram_entropy",
]

log = logging.getLogger(__name__)
TRAIN, VAL = 0, 1  # stream ids: train and val batches never share a random stream


class DataError(ValueError):
    """The data cannot be used for training; the message says why and what to do."""


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, lossless for any text, no files to ship."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (its UTF-8 bytes)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int] | torch.Tensor, *, errors: str = "replace") -> str:
        """Text of `ids`; invalid UTF-8 (possible in samples) becomes U+FFFD by default."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(ids).decode("utf-8", errors=errors)


@dataclass(frozen=True)
class Corpus:
    """Train and validation token arrays (possibly memory-mapped) and where they came from."""

    train: np.ndarray
    val: np.ndarray
    source: str
    vocab_size: int

    def describe(self) -> str:
        """One line for the run header."""
        return f"{self.source}: {len(self.train):,} train / {len(self.val):,} val tokens"


def _is_val_file(i: int, fraction: float) -> bool:
    """Put file i in validation so that exactly `fraction` of files (by count) go there."""
    return int((i + 1) * fraction) > int(i * fraction)


def _read_files(
    files: list[Path], budget: int, fraction: float, what: str, *, quiet: bool = False
) -> tuple[bytes, bytes]:
    """Concatenate files in order up to `budget` bytes, split into train/val by file.

    Leaving files out is announced (a warning for user data; info for the stdlib corpus,
    where the budget is the point).
    """
    train, val, total = bytearray(), bytearray(), 0
    for i, f in enumerate(files):
        if total >= budget:
            level = logging.INFO if quiet else logging.WARNING
            log.log(
                level,
                "%s: --data.max-bytes %d reached; %d files left out",
                what,
                budget,
                len(files) - i,
            )
            break
        data = f.read_bytes()[: budget - total]
        if b"\0" in data[:8192]:
            log.warning("%s: skipping %s, it looks binary", what, f)
            continue
        (val if _is_val_file(i, fraction) else train).extend(data)
        total += len(data)
    return bytes(train), bytes(val)


@functools.cache
def _stdlib_files() -> tuple[Path, tuple[Path, ...]]:
    """The interpreter's stdlib `.py` files in sorted path order (listed once per process)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return root, tuple(sorted(f for f in root.rglob("*.py") if "site-packages" not in f.parts))


def _split_tail(tokens: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Split one array: the last `fraction` is validation."""
    cut = len(tokens) - int(len(tokens) * fraction)
    return tokens[:cut], tokens[cut:]


def _load_array(path: Path, bin_dtype: str) -> np.ndarray:
    """Memory-map a .npy or raw .bin token file without reading it into RAM."""
    if path.suffix == ".npy":
        arr = np.load(path, mmap_mode="r")
    else:
        arr = np.memmap(path, dtype=np.dtype(bin_dtype), mode="r")
    if arr.ndim != 1 or arr.dtype not in (np.uint8, np.uint16):
        raise DataError(
            f"{path}: expected a 1-D uint8 or uint16 token array, got {arr.ndim}-D {arr.dtype}; "
            "save token ids with np.asarray(ids, dtype=np.uint16)"
        )
    return arr


def _check_vocab(arr: np.ndarray, vocab_size: int, path: Path) -> None:
    """Refuse token ids outside the model's vocabulary (reads the array once, in chunks)."""
    chunk = 1 << 24
    top = max((int(arr[i : i + chunk].max()) for i in range(0, len(arr), chunk)), default=0)
    if top >= vocab_size:
        raise DataError(
            f"{path}: token id {top} >= vocabulary size {vocab_size}; "
            f"pass --model.vocab-size {top + 1} (or larger)"
        )


def load_corpus(
    path: str | None,
    *,
    max_bytes: int,
    val_fraction: float,
    vocab_size: int = 256,
    bin_dtype: str = "uint16",
) -> Corpus:
    """Load the corpus named by `--data.path` (None: the stdlib sources) as token arrays."""
    if path is None:
        root, files = _stdlib_files()
        train, val = _read_files(list(files), max_bytes, val_fraction, "stdlib corpus", quiet=True)
        source = f"Python stdlib sources ({root})"
    else:
        p = Path(path).expanduser()
        if not p.exists():
            raise DataError(f"--data.path {path}: no such file or directory")
        if p.suffix in (".npy", ".bin"):
            arr = _load_array(p, bin_dtype)
            _check_vocab(arr, vocab_size, p)
            tr, va = _split_tail(arr, val_fraction)
            return _checked(Corpus(tr, va, str(p), vocab_size), path)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file())
            train, val = _read_files(found, max_bytes, val_fraction, str(p))
        else:
            train, val = _read_files([p], max_bytes, 0.0, str(p))
        if not val:  # a single file, or too few files to hold one out: split the bytes
            whole = np.frombuffer(train + val, dtype=np.uint8)
            tr_arr, va_arr = _split_tail(whole, val_fraction)
            return _checked(Corpus(tr_arr, va_arr, str(p), vocab_size), path)
        source = str(p)
    corpus = Corpus(np.frombuffer(train, np.uint8), np.frombuffer(val, np.uint8), source, 256)
    return _checked(corpus, path)


def _checked(corpus: Corpus, path: str | None) -> Corpus:
    """Refuse an empty corpus with a message naming it."""
    if len(corpus.train) + len(corpus.val) == 0:
        raise DataError(f"--data.path {path}: the corpus is empty; point it at text or tokens")
    return corpus


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


def unigram_entropy(corpus: Corpus) -> float:
    """Cross-entropy (nats/token) on val of a unigram model fitted on train: the baseline."""
    counts = np.bincount(corpus.train, minlength=corpus.vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    val_counts = np.bincount(corpus.val, minlength=corpus.vocab_size)
    return float(-(val_counts * logp).sum() / max(val_counts.sum(), 1))
