"""Where a run's data comes from, before any tokenizer: text or token ids, split train/val.

`--data.path` may name the default (None: the interpreter's stdlib sources), a text file, a
folder or a glob of text files, a `.bin`/`.npy` token array, or a prepared folder holding
`train.bin` and `val.bin` (`isotrain prepare`'s output, with `meta.json`, or nanoGPT's layout,
without one). Token files are memory-mapped, never read into RAM; every way a token file can
be unusable is a one-line `DataError` saying what, why and what to try.
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "META_FILE",
    "DataError",
    "PreparedMeta",
    "TextData",
    "TokenData",
    "find_files",
    "is_val_file",
    "load_token_file",
    "open_data",
    "read_meta",
]

log = logging.getLogger(__name__)
META_FILE = "meta.json"
TOKEN_DTYPES = ("uint8", "uint16", "uint32")


class DataError(ValueError):
    """The data cannot be used for training; the message says why and what to do."""


@dataclass(frozen=True)
class TextData:
    """Raw text bytes of each split, to be tokenized by the run's tokenizer."""

    train: bytes
    val: bytes
    source: str


@dataclass(frozen=True)
class PreparedMeta:
    """What `isotrain prepare` records beside `train.bin` / `val.bin`."""

    folder: Path
    dtype: str
    vocab_size: int
    tokenizer: str  # "bytes" or a file name inside `folder`
    tokenizer_sha256: str
    split_bytes: dict[str, int]  # UTF-8 bytes of text behind each split's tokens
    split_tokens: dict[str, int]  # tokens of each split: checked against the files' sizes


@dataclass(frozen=True)
class TokenData:
    """Token ids of each split (memory-mapped), the prepared folder's meta if any, and the
    bytes of text behind the val tokens when a meta file records them."""

    train: np.ndarray
    val: np.ndarray
    source: str
    meta: PreparedMeta | None = None
    val_bytes: int | None = None


def is_val_file(i: int, fraction: float) -> bool:
    """Put file i in validation so that exactly `fraction` of files (by count) go there."""
    return int((i + 1) * fraction) > int(i * fraction)


def find_files(spec: str, flag: str = "--data.path") -> list[Path]:
    """The files `spec` names: one file, every file under a folder, or a glob (`**` recurses)."""
    p = Path(spec).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        return sorted(f for f in p.rglob("*") if f.is_file())
    if any(c in spec for c in "*?["):
        found = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
        if found:
            return found
        raise DataError(f"{flag} {spec}: the pattern matches no file; check the path and quotes")
    raise DataError(f"{flag} {spec}: no such file or directory")


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
            log.log(level, "%s: %d bytes read; %d files left out", what, budget, len(files) - i)
            break
        data = f.read_bytes()[: budget - total]
        if b"\0" in data[:8192]:
            log.warning("%s: skipping %s, it looks binary", what, f)
            continue
        (val if is_val_file(i, fraction) else train).extend(data)
        total += len(data)
    return bytes(train), bytes(val)


@functools.cache
def _stdlib_files() -> tuple[Path, tuple[Path, ...]]:
    """The interpreter's stdlib `.py` files in sorted path order (listed once per process);
    site-packages is never entered (it can hold 50,000 files: 0.6 s of a run's start)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != "site-packages"]
        found += [Path(folder, n) for n in names if n.endswith(".py")]
    return root, tuple(sorted(found))


def _split_tail(tokens: Any, fraction: float) -> tuple[Any, Any]:
    """Split one array or byte string: the last `fraction` is validation."""
    cut = len(tokens) - int(len(tokens) * fraction)
    return tokens[:cut], tokens[cut:]


def load_token_file(path: Path, dtype: str) -> np.ndarray:
    """Memory-map a `.npy` or raw `.bin` token file without reading it into RAM."""
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"{path}: the token file is empty; prepare it again (isotrain prepare)")
    if path.suffix == ".npy":
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            raise DataError(
                f"{path}: not a plain .npy array ({e}); isotrain never unpickles data files: "
                "save token ids with np.save(path, np.asarray(ids, dtype=np.uint16))"
            ) from e
    else:
        item = np.dtype(dtype).itemsize
        if size % item:
            raise DataError(
                f"{path}: {size} bytes is not a whole number of {dtype} tokens ({item} bytes "
                f"each); was it written with another dtype? try --data.bin-dtype "
                f"{' or '.join(d for d in TOKEN_DTYPES if d != dtype)}"
            )
        arr = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    if arr.ndim != 1 or arr.dtype.name not in TOKEN_DTYPES:
        raise DataError(
            f"{path}: expected a 1-D uint8, uint16 or uint32 token array, got {arr.ndim}-D "
            f"{arr.dtype}; save token ids with np.asarray(ids, dtype=np.uint16)"
        )
    return arr


def read_meta(folder: Path) -> PreparedMeta | None:
    """The prepared folder's `meta.json`, checked; None when there is none (nanoGPT layout)."""
    path = folder / META_FILE
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        splits = raw["splits"]
        meta = PreparedMeta(
            folder=folder,
            dtype=str(raw["dtype"]),
            vocab_size=_count(raw["vocab_size"], "vocab_size", low=1),
            tokenizer=str(raw["tokenizer"]),
            tokenizer_sha256=str(raw.get("tokenizer_sha256", "")),
            split_bytes={k: _count(v["bytes"], f"{k} bytes") for k, v in splits.items()},
            split_tokens={k: _count(v["tokens"], f"{k} tokens") for k, v in splits.items()},
        )
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DataError(f"{path}: unreadable meta file ({e!r}); run isotrain prepare again") from e
    if meta.dtype not in TOKEN_DTYPES or Path(meta.tokenizer).name != meta.tokenizer:
        raise DataError(f"{path}: bad dtype or tokenizer entry; run isotrain prepare again")
    if meta.vocab_size > 1 << (8 * np.dtype(meta.dtype).itemsize):
        raise DataError(
            f"{path}: vocab_size {meta.vocab_size} does not fit its dtype {meta.dtype}; "
            "run isotrain prepare again"
        )
    return meta


def _count(value: Any, what: str, *, low: int = 0) -> int:
    """A whole number of at least `low` from meta.json (a bool, float or string is not one)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{what} is {value!r}, not a whole number >= {low}")
    return value


def _check_tokens(arr: np.ndarray, meta: PreparedMeta | None, split: str, path: Path) -> None:
    """The token file holds as many tokens as meta.json records (else the dtype lies)."""
    claimed = meta.split_tokens.get(split) if meta else None
    if claimed is not None and claimed != len(arr):
        raise DataError(
            f"{path}: holds {len(arr)} {arr.dtype} tokens, but meta.json records {claimed}: "
            "the file or its dtype is not what meta.json says; run isotrain prepare again"
        )


def _prepared(folder: Path, val_path: str | None, fraction: float, dtype: str) -> TokenData:
    """A folder with `train.bin` (and `val.bin`): isotrain prepare's or nanoGPT's layout."""
    meta = read_meta(folder)
    dtype = meta.dtype if meta else dtype
    train = load_token_file(folder / "train.bin", dtype)
    _check_tokens(train, meta, "train", folder / "train.bin")
    if val_path is not None or (folder / "val.bin").is_file():
        val, val_bytes = _val_tokens(val_path or str(folder), dtype)
        return TokenData(train, val, str(folder), meta, val_bytes)
    log.warning("%s has no val.bin: the last %g of train.bin is validation", folder, fraction)
    tr, va = _split_tail(train, fraction)
    return TokenData(tr, va, str(folder), meta)


def _val_tokens(val_path: str, dtype: str) -> tuple[np.ndarray, int | None]:
    """Validation tokens from a token file or a prepared folder, and their text's bytes."""
    p = Path(val_path).expanduser()
    if p.is_dir() and (p / "val.bin").is_file():
        meta = read_meta(p)
        val = load_token_file(p / "val.bin", meta.dtype if meta else dtype)
        _check_tokens(val, meta, "val", p / "val.bin")
        return val, meta.split_bytes.get("val") if meta else None
    if p.suffix in (".bin", ".npy") and p.is_file():
        return load_token_file(p, dtype), None
    raise DataError(
        f"--data.val-path {val_path}: expected a .bin/.npy token file or a folder with val.bin, "
        "since --data.path holds token ids; prepare both with the same tokenizer"
    )


def _text(spec: str, val_path: str | None, fraction: float, max_bytes: int) -> TextData:
    """Text from a file, a folder or a glob; validation by file, from the tail, or val_path."""
    files = find_files(spec)
    if sum(f.stat().st_size for f in files) > max_bytes:
        log.info(
            "%s: reading all of it (--data.max-bytes limits only the default stdlib corpus; "
            "isotrain prepare memory-maps a corpus of any size)",
            spec,
        )
    if val_path is not None:
        train, _ = _read_files(files, 1 << 62, 0.0, spec)
        val, _ = _read_files(find_files(val_path, "--data.val-path"), 1 << 62, 0.0, val_path)
        return TextData(train, val, spec)
    train, val = _read_files(files, 1 << 62, fraction if len(files) > 1 else 0.0, spec)
    if not val:  # one file, or too few files to hold one out: split the bytes
        train, val = _split_tail(train, fraction)
    return TextData(train, val, spec)


def open_data(
    path: str | None,
    *,
    val_path: str | None = None,
    max_bytes: int,
    val_fraction: float,
    bin_dtype: str = "uint16",
) -> TextData | TokenData:
    """The data `--data.path` (and `--data.val-path`) name, split into train and val."""
    if path is None:
        root, files = _stdlib_files()
        train, val = _read_files(list(files), max_bytes, val_fraction, "stdlib corpus", quiet=True)
        data: TextData | TokenData = TextData(train, val, f"Python stdlib sources ({root})")
    else:
        p = Path(path).expanduser()
        if p.is_dir() and (p / "train.bin").is_file():
            data = _prepared(p, val_path, val_fraction, bin_dtype)
        elif p.suffix in (".npy", ".bin") and p.is_file():
            arr = load_token_file(p, bin_dtype)
            if val_path is not None:
                va, va_bytes = _val_tokens(val_path, bin_dtype)
                data = TokenData(arr, va, str(p), None, va_bytes)
            else:
                data = TokenData(*_split_tail(arr, val_fraction), source=str(p))
        else:
            data = _text(path, val_path, val_fraction, max_bytes)
    if len(data.train) + len(data.val) == 0:
        raise DataError(f"--data.path {path}: the corpus is empty; point it at text or tokens")
    return data
