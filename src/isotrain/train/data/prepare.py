"""`isotrain prepare`: text on disk -> `train.bin` / `val.bin` token files plus `meta.json`.

The output is nanoGPT's layout (flat arrays, uint16, or uint32 when the vocabulary needs it)
with a small meta file naming the tokenizer (copied beside it as `tokenizer.json`), its
sha256, and the bytes of text behind each split, so a run on it reports bits per byte.
Input is streamed in pieces of about a megabyte, so a corpus larger than RAM is prepared and
then trained memory-mapped. Inputs: text files, folders, globs; `.jsonl` (one JSON object
per line, `--text-field`); `.json` and `.parquet` through Hugging Face `datasets` if it is
installed. Records are separated by a blank line.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from isotrain.train.data.batches import token_dtype
from isotrain.train.data.sources import META_FILE, DataError, find_files, is_val_file
from isotrain.train.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from isotrain.train.files import check_regular, make_dir, new_file, remove_stale

__all__ = ["Part", "plan_parts", "prepare"]

log = logging.getLogger(__name__)
BLOCK = 1 << 20  # bytes read per piece of text
DATASETS_SUFFIXES = {".json": "json", ".parquet": "parquet"}
TOKENIZER_FILE = "tokenizer.json"  # a trained (BPE) tokenizer, beside the token files


@dataclass(frozen=True)
class Part:
    """A range of one input file going to one split: bytes for text, rows for datasets."""

    split: str
    path: Path
    start: int
    end: int


def _datasets_rows(path: Path) -> Any:
    """The rows of a `.json` / `.parquet` file through Hugging Face `datasets` (optional)."""
    try:
        import datasets
    except ImportError as e:
        raise DataError(
            f"{path}: .json and .parquet inputs are read through Hugging Face datasets: "
            "pip install datasets (or convert to .jsonl, read without it)"
        ) from e
    return datasets.load_dataset(
        DATASETS_SUFFIXES[path.suffix], data_files=[str(path)], split="train"
    )


def _size(path: Path) -> int:
    return len(_datasets_rows(path)) if path.suffix in DATASETS_SUFFIXES else path.stat().st_size


def _line_cut(path: Path, at: int) -> int:
    """The first line start at or after byte `at` (the end of the file if none)."""
    if at == 0:
        return 0
    with path.open("rb") as f:
        f.seek(at - 1)
        while chunk := f.read(1 << 16):
            nl = chunk.find(b"\n")
            if nl >= 0:
                return f.tell() - len(chunk) + nl + 1
    return path.stat().st_size


def plan_parts(inputs: list[Path], val_inputs: list[Path], val_fraction: float) -> list[Part]:
    """Train/val ranges: a separate val input, else whole files by count (as the trainer
    splits a folder), else the tail of the inputs, cut at a line start."""
    if val_inputs:
        return [Part("train", p, 0, _size(p)) for p in inputs] + [
            Part("val", p, 0, _size(p)) for p in val_inputs
        ]
    sizes = [_size(p) for p in inputs]
    by_file = [is_val_file(i, val_fraction) for i in range(len(inputs))]
    if len(inputs) > 1 and any(by_file):
        return [Part("val" if v else "train", p, 0, n) for p, n, v in zip(inputs, sizes, by_file)]
    cut, parts, seen = sum(sizes) - int(sum(sizes) * val_fraction), [], 0
    for p, n in zip(inputs, sizes):
        at = min(max(cut - seen, 0), n)
        if 0 < at < n and p.suffix not in DATASETS_SUFFIXES:
            at = _line_cut(p, at)
        parts += [Part("train", p, 0, at)] if at else []
        parts += [Part("val", p, at, n)] if at < n else []
        seen += n
    return parts


def _text_pieces(part: Part) -> Iterator[tuple[str, int]]:
    """(text, bytes read) of a byte range, in pieces that end at a line end where possible."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    carry = ""
    with part.path.open("rb") as f:
        f.seek(part.start)
        left = part.end - part.start
        while left > 0 and (raw := f.read(min(BLOCK, left))):
            left -= len(raw)
            text = carry + decoder.decode(raw)
            cut = text.rfind("\n") + 1 or (len(text) if len(text) > 4 * BLOCK else 0)
            piece, carry = text[:cut], text[cut:]
            yield piece, len(raw)
    tail = carry + decoder.decode(b"", final=True)
    if tail:
        yield tail, 0


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # JSON can escape them; UTF-8 cannot hold them


def _record_text(record: Any, field: str, where: str) -> tuple[str, int]:
    """The record's text and a blank line, with lone surrogates (valid JSON escapes that no
    UTF-8 can hold) replaced by U+FFFD; and how many were replaced."""
    if not isinstance(record, dict) or not isinstance(record.get(field), str):
        raise DataError(f"{where}: no text field {field!r}; pass --text-field NAME")
    text, replaced = _LONE_SURROGATE.subn("\ufffd", record[field])
    return text + "\n\n", replaced


def _line_number(path: Path, pos: int) -> int:
    """The number of the line starting at byte `pos` (counted only when a line is refused)."""
    with path.open("rb") as f:
        return 1 + sum(f.read(min(BLOCK, pos - at)).count(b"\n") for at in range(0, pos, BLOCK))


def _jsonl_record(line: bytes, path: Path, pos: int) -> Any:
    """One JSONL record, or a DataError naming the file and line."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError) as e:  # RecursionError: nested thousands deep
        why = "it is nested too deep to read" if isinstance(e, RecursionError) else str(e)
        raise DataError(
            f"{path} line {_line_number(path, pos)}: not a JSON record ({why}); fix or drop "
            "that line"
        ) from None


def _jsonl_pieces(part: Part, field: str, *, warn: bool) -> Iterator[tuple[str, int]]:
    replaced = 0
    with part.path.open("rb") as f:
        f.seek(part.start)
        pos = part.start
        while pos < part.end and (line := f.readline()):
            if line.strip():
                record = _jsonl_record(line, part.path, pos)
                text, n = _record_text(record, field, str(part.path))
                replaced += n
                yield text, len(line)
            pos += len(line)
    if replaced and warn:
        log.warning(
            "%s: %d lone surrogate escapes (text UTF-8 cannot hold) replaced by U+FFFD",
            part.path,
            replaced,
        )


def _rows_pieces(part: Part, field: str) -> Iterator[tuple[str, int]]:
    rows = _datasets_rows(part.path)
    for i in range(part.start, part.end):
        yield _record_text(rows[i], field, f"{part.path} row {i}")[0], 1


def pieces(part: Part, field: str, *, warn: bool = True) -> Iterator[tuple[str, int]]:
    """(text, progress units) of a part, whatever its format (`warn`: say what was replaced)."""
    if part.path.suffix == ".jsonl":
        return _jsonl_pieces(part, field, warn=warn)
    if part.path.suffix in DATASETS_SUFFIXES:
        return _rows_pieces(part, field)
    return _text_pieces(part)


def _bpe_text(
    parts: list[Part], field: str, budget: int, advance: Callable[[int], None]
) -> Iterator[str]:
    """Training text for BPE merges: the train parts, up to `budget` bytes."""
    seen = 0
    for part in (p for p in parts if p.split == "train"):
        for text, n in pieces(part, field, warn=False):  # the tokenize pass says it once
            advance(n)
            yield text
            seen += len(text)
            if seen >= budget:
                return


def _encode(tok: Tokenizer, texts: list[str], dtype: np.dtype) -> np.ndarray:
    if isinstance(tok, ByteTokenizer):  # no Python list of ints per byte
        return np.frombuffer("".join(texts).encode("utf-8"), dtype=np.uint8).astype(dtype)
    parts = [np.asarray(ids, dtype=dtype) for ids in tok.encode_many(texts)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


class _Writer:
    """Appends token ids of one split to its (fresh, temporary) file; counts tokens and bytes."""

    def __init__(self, file: BinaryIO, dtype: np.dtype) -> None:
        self.file, self.dtype = file, dtype
        self.tokens = self.bytes = 0

    def write(self, tok: Tokenizer, texts: list[str]) -> None:
        ids = _encode(tok, texts, self.dtype)
        ids.tofile(self.file)
        self.tokens += len(ids)
        self.bytes += sum(len(t.encode("utf-8")) for t in texts)


def _write_splits(
    parts: list[Part],
    tok: Tokenizer,
    writers: dict[str, _Writer],
    field: str,
    advance: Callable[[int], None],
) -> dict[str, dict[str, Any]]:
    """Tokenize every part into its split's writer, 16 pieces per batch."""
    for part in parts:
        batch: list[str] = []
        for text, n in pieces(part, field):
            batch.append(text)
            advance(n)
            if len(batch) == 16:
                writers[part.split].write(tok, batch)
                batch = []
        writers[part.split].write(tok, batch)
    return {
        s: {"file": f"{s}.bin", "tokens": w.tokens, "bytes": w.bytes} for s, w in writers.items()
    }


def _progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        disable=not enabled,
    )


def _tokenizer(
    spec: str, vocab_size: int, parts: list[Part], field: str, budget: int, bar: Progress
) -> Tokenizer:
    """bytes, a BPE learned from the train parts, or a tokenizer.json."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec != "bpe":
        return HFTokenizer.from_file(spec)
    if vocab_size <= 256:
        raise DataError(f"--vocab-size {vocab_size}: a BPE needs more than 256 tokens; try 1024")
    total = min(budget, sum(p.end - p.start for p in parts if p.split == "train"))
    task = bar.add_task("learn BPE merges", total=total)
    texts = _bpe_text(parts, field, budget, lambda n: bar.advance(task, n))
    return HFTokenizer.train_bpe(texts, vocab_size)


def prepare(
    inputs: list[str],
    out: str | Path,
    *,
    val_input: str | None = None,
    tokenizer: str = "bytes",
    vocab_size: int = 1024,
    val_fraction: float = 0.1,
    text_field: str = "text",
    bpe_train_bytes: int = 100_000_000,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize `inputs` into `out`/train.bin, val.bin, meta.json; returns the meta record."""
    root = Path(out).expanduser()
    if (root / "train.bin").exists() and not overwrite:
        raise DataError(f"--out {out} already holds train.bin; pass --overwrite or another --out")
    if not 0 < val_fraction < 1:
        raise DataError(f"--val-fraction {val_fraction} is invalid: use (0, 1); try 0.1")
    files = [f for spec in inputs for f in find_files(spec, "--input")]
    val_files = find_files(val_input, "--val-input") if val_input else []
    parts = plan_parts(files, val_files, val_fraction)
    created = not root.exists()
    make_dir(root, follow=True)  # the folder the user named; its files are never followed
    remove_stale(root)  # what a killed prepare left
    try:
        with _progress(progress) as bar, contextlib.ExitStack() as opened:
            tok = _tokenizer(tokenizer, vocab_size, parts, text_field, bpe_train_bytes, bar)
            task = bar.add_task("tokenize", total=sum(p.end - p.start for p in parts))
            dtype = token_dtype(tok.vocab_size)
            # NOTE [prepare publishes whole]: every file goes to a fresh temporary, written and
            # flushed inside this block; only then are they renamed, token files first and
            # meta.json last (an ExitStack exits in reverse). A full disk or a bad record at any
            # point leaves the folder as it was.
            outputs = {META_FILE: opened.enter_context(new_file(root / META_FILE))}
            trained = tok if isinstance(tok, HFTokenizer) else None
            if trained is not None:
                outputs[TOKENIZER_FILE] = opened.enter_context(new_file(root / TOKENIZER_FILE))
            writers = {s: _Writer(opened.enter_context(new_file(root / f"{s}.bin")), dtype)
                       for s in ("train", "val")}  # fmt: skip
            splits = _write_splits(parts, tok, writers, text_field, lambda n: bar.advance(task, n))
            _check_splits(splits)
            meta = _meta(tok, splits)
            if trained is not None:
                outputs[TOKENIZER_FILE].write(trained.json.encode("utf-8"))
            outputs[META_FILE].write((json.dumps(meta, indent=2) + "\n").encode("utf-8"))
            for f in [*outputs.values(), *(w.file for w in writers.values())]:
                f.flush()
            _drop_stale_meta(root)
    except BaseException:  # a full disk, a bad record, Ctrl-C: the temporaries are gone already
        if created:
            with contextlib.suppress(OSError):
                root.rmdir()  # only while empty
        raise
    log.info(
        "%s: %d train / %d val tokens", root, splits["train"]["tokens"], splits["val"]["tokens"]
    )
    return meta


def _drop_stale_meta(root: Path) -> None:
    """New token files are never left beside an old meta.json, even half published."""
    if check_regular(root / META_FILE):  # a link or FIFO planted there is refused
        (root / META_FILE).unlink()


def _check_splits(splits: dict[str, dict[str, Any]]) -> None:
    empty = [s for s, c in splits.items() if c["tokens"] == 0]
    if empty:
        raise DataError(
            f"the {' and '.join(empty)} split came out empty; give more text, a larger "
            "--val-fraction, or --val-input"
        )


def _meta(tok: Tokenizer, splits: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The meta.json record: format, token dtype, vocabulary, tokenizer and its hash, splits."""
    return {
        "format": "isotrain-tokens",
        "version": 1,
        "dtype": token_dtype(tok.vocab_size).name,
        "vocab_size": tok.vocab_size,
        "tokenizer": TOKENIZER_FILE if isinstance(tok, HFTokenizer) else "bytes",
        "tokenizer_sha256": tok.sha256,
        "splits": splits,
    }
