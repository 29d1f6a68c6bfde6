"""Tokenizers: UTF-8 bytes (the default), Hugging Face `tokenizers` files, and raw token ids.

Every tokenizer answers the same few questions: its vocabulary size, encode and decode, an
identity (`sha256` of its canonical JSON, "" for bytes and ids) and how many UTF-8 bytes each
token stands for, which turns a loss per token into bits per byte. Byte-level BPE is trained
locally from the user's text (nothing is downloaded); `tokenizers` is imported only when a
BPE or a `tokenizer.json` is used (`pip install 'isotrain[data]'`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from isotrain.train.data.sources import DataError
from isotrain.train.files import replace_file

__all__ = [
    "RUN_TOKENIZER",
    "ByteTokenizer",
    "HFTokenizer",
    "IdsTokenizer",
    "Tokenizer",
    "byte_level_json",
    "from_metadata",
    "run_tokenizer",
    "text_chunks",
    "tokenizers_module",
]

log = logging.getLogger(__name__)


class Tokenizer(Protocol):
    """What the trainer needs of a tokenizer."""

    kind: str  # "bytes" | "hf" | "ids"
    vocab_size: int
    sha256: str  # identity of an HF tokenizer's JSON; "" for bytes and ids

    def encode(self, text: str) -> list[int]: ...
    def encode_many(self, texts: list[str]) -> list[list[int]]: ...
    def decode(self, ids: list[int] | torch.Tensor) -> str: ...
    def byte_lengths(self) -> np.ndarray | None: ...
    def describe(self) -> str: ...


def _as_list(ids: list[int] | torch.Tensor) -> list[int]:
    return ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, lossless for any text, no files to ship."""

    kind = "bytes"
    vocab_size = 256
    sha256 = ""

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (its UTF-8 bytes)."""
        return list(text.encode("utf-8"))

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int] | torch.Tensor, *, errors: str = "replace") -> str:
        """Text of `ids`; invalid UTF-8 (possible in samples) becomes U+FFFD by default."""
        return bytes(_as_list(ids)).decode("utf-8", errors=errors)

    def byte_lengths(self) -> np.ndarray:
        """Every token is one byte."""
        return np.ones(256, dtype=np.int64)

    def describe(self) -> str:
        """One line for the run header."""
        return "bytes (UTF-8, 256 tokens)"


class IdsTokenizer:
    """Token ids with no text behind them (a prepared corpus whose tokenizer is unknown).

    Prompts are integers separated by spaces; samples print as integers. No bits per byte.
    """

    kind = "ids"
    sha256 = ""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        """The integers in `text` that are valid ids."""
        return [i for i in map(int, re.findall(r"\d+", text)) if i < self.vocab_size]

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """The ids as text, each after a space (so a sample continues its prompt)."""
        return "".join(f" {i}" for i in _as_list(ids))

    def byte_lengths(self) -> None:
        """Unknown: ids without a tokenizer have no bytes."""
        return None

    def describe(self) -> str:
        """One line for the run header."""
        return f"ids (no tokenizer, {self.vocab_size} tokens)"


def tokenizers_module() -> Any:
    """The `tokenizers` package, or an ImportError that says how to install it."""
    try:
        import tokenizers
    except ImportError as e:
        raise ImportError(
            "BPE and tokenizer.json files need Hugging Face tokenizers: "
            "pip install 'isotrain[data]'"
        ) from e
    return tokenizers


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` (any `tokenizer.json`), byte-level BPE included."""

    kind = "hf"

    def __init__(self, tok: Any, *, source: str = "") -> None:
        self.tok = tok
        self.json = tok.to_str()
        self.sha256 = hashlib.sha256(self.json.encode("utf-8")).hexdigest()
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        self.source = source

    @classmethod
    def from_file(cls, path: str | Path) -> HFTokenizer:
        """Load a `tokenizer.json`; a file that is not one is a DataError naming it."""
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"{path}: no such tokenizer file")
        try:
            tok = tokenizers_module().Tokenizer.from_str(p.read_text(encoding="utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise DataError(
                f"{path}: not a tokenizer.json ({e}); save one with tokenizers.Tokenizer.save"
            ) from e
        return cls(tok, source=str(p))

    @classmethod
    def train_bpe(cls, texts: Iterable[str], vocab_size: int) -> HFTokenizer:
        """Byte-level BPE with `vocab_size` tokens (256 byte tokens + merges), trained here.

        Like GPT-2's: lossless for any text, no unknown token, no special tokens.
        """
        tk = tokenizers_module()
        tok = tk.Tokenizer(tk.models.BPE())
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok, source="byte-level BPE trained here")

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens added)."""
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, encoded in parallel."""
        return [list(e.ids) for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """Text of `ids` (partial UTF-8 at the end of a sample becomes U+FFFD)."""
        return str(self.tok.decode(_as_list(ids), skip_special_tokens=False))

    def save(self, path: str | Path) -> Path:
        """Write the canonical JSON (whose sha256 is `self.sha256`) through a fresh temporary
        file and a rename: never through a link, FIFO or directory planted at `path`."""
        return replace_file(path, self.json)

    def byte_lengths(self) -> np.ndarray:
        """UTF-8 bytes per token id: exact for byte-level tokenizers, else from decoding."""
        spec = json.loads(self.json)
        byte_level = (spec.get("decoder") or {}).get("type") == "ByteLevel"
        special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        out = np.zeros(self.vocab_size, dtype=np.int64)
        for i in range(self.vocab_size):
            token = self.tok.id_to_token(i)
            if i in special or token is None:
                continue
            out[i] = len(token) if byte_level else len(self.tok.decode([i]).encode("utf-8"))
        return out

    def describe(self) -> str:
        """One line for the run header."""
        where = self.source or "tokenizer.json"
        return f"{where} ({self.vocab_size} tokens, sha256 {self.sha256[:12]})"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level tokenizers store tokens in."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def byte_level_json() -> str:
    """A `tokenizer.json` whose ids are exactly `ByteTokenizer`'s (byte value = id).

    Exported with a bytes run, so `AutoTokenizer` reads the run's text as isotrain does.
    """
    tk = tokenizers_module()
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tk.decoders.ByteLevel()
    return str(tok.to_str())


def text_chunks(text: str, size: int = 1 << 16) -> Iterator[str]:
    """`text` in pieces of about `size` characters, cut after a newline where there is one."""
    start = 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            cut = text.rfind("\n", start, end)
            end = cut + 1 if cut > start else end
        yield text[start:end]
        start = end


RUN_TOKENIZER = "tokenizer.json"  # a run's tokenizer, beside its snapshots (HF tokenizers only)


def run_tokenizer(run_dir: str | Path, config: dict[str, Any]) -> Tokenizer:
    """The tokenizer a run trained with, from RUN/tokenizer.json and its stored config.

    The file's sha256 must be the one the config recorded ('' for bytes and ids, which have no
    file): a changed file, or one planted into a run that trained without one, is refused.
    """
    path = Path(run_dir) / RUN_TOKENIZER
    expected = str(config.get("tokenizer_sha256") or "")
    if path.is_file() or path.is_symlink():
        if not expected:
            raise DataError(
                f"{path}: the run trained on bytes or ids, without a tokenizer file, so this "
                "one was put there after training; remove it"
            )
        tok = HFTokenizer.from_file(path)
        if tok.sha256 != expected:
            raise DataError(
                f"{path}: sha256 {tok.sha256[:12]}… is not the {expected[:12]}… the run trained "
                "with; the file was changed after training: restore it"
            )
        return tok
    if expected:
        raise FileNotFoundError(f"{path}: missing, but the run trained with a tokenizer file")
    if config.get("tokenizer") == "ids":
        return IdsTokenizer(int(config["model"]["vocab_size"]))
    return ByteTokenizer()


def from_metadata(value: str | None, vocab_size: int) -> Tokenizer:
    """The tokenizer an isotrain `.safetensors` file records ("bytes", "ids" or JSON)."""
    if value in (None, "bytes"):
        return ByteTokenizer()
    if value == "ids":
        return IdsTokenizer(vocab_size)
    return HFTokenizer(tokenizers_module().Tokenizer.from_str(value), source="export metadata")
