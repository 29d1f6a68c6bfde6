"""What a run starts from besides its config: the tokenizer and, to fine-tune, the weights.

# NOTE [tokenizer resolution]
`--tokenizer auto` (the default) takes, in order: the run's own RUN/tokenizer.json when it
resumes, the tokenizer of `--init-from`, the one a prepared dataset's meta.json names, else
bytes. An explicit choice must agree with all of those (one identity: bytes, ids, or the
sha256 of the tokenizer's JSON); a disagreement is refused, naming both. BPE training is
deterministic (same text, same merges, whatever the thread count), so every rank of a
distributed run trains the same BPE and only rank 0 writes RUN/tokenizer.json.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from isotrain.train.config import ConfigError, TrainConfig, flag
from isotrain.train.data.batches import Corpus, build_corpus
from isotrain.train.data.sources import TextData, TokenData, open_data
from isotrain.train.data.tokenizer import (
    RUN_TOKENIZER,
    ByteTokenizer,
    HFTokenizer,
    IdsTokenizer,
    Tokenizer,
    text_chunks,
)
from isotrain.train.files import check_regular, make_dir
from isotrain.train.model.gpt import GPT
from isotrain.train.rules import validate
from isotrain.train.rundir.resume import ways_on
from isotrain.train.rundir.snapshot import SnapshotError, find_snapshots
from isotrain.train.rundir.writes import writing
from isotrain.train.weights.load import load_with_tokenizer

__all__ = [
    "InitSource",
    "adopt_shape",
    "fit_vocab",
    "load_inputs",
    "read_init",
    "resolve_tokenizer",
    "save_tokenizer",
]

log = logging.getLogger(__name__)
BPE_TRAIN_BYTES = 64 << 20  # BPE merges are learned from at most this much training text


@dataclass(frozen=True)
class InitSource:
    """Weights to fine-tune (a CPU model) and the tokenizer they were trained with, if known."""

    spec: str
    model: GPT
    tokenizer: Tokenizer | None


def read_init(spec: str) -> InitSource:
    """Load `--init-from RUN_DIR | FILE.safetensors | hf:FOLDER` (weights only)."""
    try:
        model, tok = load_with_tokenizer(spec)
    except (ValueError, SnapshotError) as e:
        text, path = str(e), Path(spec.removeprefix("hf:")).expanduser()
        named = text.startswith((str(path), str(path.parent)))  # it names the path already
        raise ConfigError(f"--init-from {text}" if named else f"--init-from {spec}: {text}") from e
    log.info("--init-from %s: %s parameters", spec, f"{model.num_params():,}")
    return InitSource(spec, model, tok)


def adopt_shape(
    cfg: TrainConfig, src: InitSource, *, origin: Mapping[str, str] | None = None
) -> TrainConfig:
    """`cfg` with the source's model shape (dropout stays the config's). A shape flag the user
    passed and the source overrides is a warning; a default or preset value is information.

    `origin` (dotted setting -> `flag`, `--preset NAME`, `--config FILE`) is the CLI's record
    of where each setting came from; without it, a value off the default counts as given.
    """
    shape = dataclasses.replace(src.model.cfg, dropout=cfg.model.dropout)
    default = type(cfg.model)()
    given, told = [], []
    for name in (f.name for f in dataclasses.fields(shape)):
        new, old, path = getattr(shape, name), getattr(cfg.model, name), f"model.{name}"
        if new == old:
            continue
        source = (origin or {}).get(path, "default")
        if origin is None and old != getattr(default, name):
            source = "flag"  # a Python caller set it
        if source == "flag":
            given.append(f"{flag(path)} {new!r} ({'you passed' if origin else 'config'} {old!r})")
        else:
            told.append(f"{flag(path)} {new!r} ({source}: {old!r})")
    if given:
        log.warning(
            "--init-from %s overrides the model shape you passed: %s", src.spec, ", ".join(given)
        )
    if told:
        log.info("--init-from %s sets the model shape: %s", src.spec, ", ".join(told))
    return dataclasses.replace(cfg, model=shape)


def _identity(tok: Tokenizer) -> str:
    return tok.sha256 or tok.kind


def _data_tokenizer(data: TextData | TokenData) -> Tokenizer | None:
    """The tokenizer a prepared dataset's meta.json names (checked against its sha256)."""
    meta = data.meta if isinstance(data, TokenData) else None
    if meta is None:
        return None
    if meta.tokenizer == "bytes":
        return ByteTokenizer()
    tok = HFTokenizer.from_file(meta.folder / meta.tokenizer)
    if meta.tokenizer_sha256 and tok.sha256 != meta.tokenizer_sha256:
        raise ConfigError(
            f"{meta.folder}: {meta.tokenizer} is not the tokenizer its meta.json records "
            "(sha256 differs); run isotrain prepare again"
        )
    return tok


def _train_bpe(data: TextData | TokenData, vocab_size: int) -> Tokenizer:
    if isinstance(data, TokenData):
        raise ConfigError(
            f"--tokenizer bpe trains on text, but {data.source} holds token ids already; "
            "drop --tokenizer (auto uses the data's) or point --data.path at text"
        )
    if len(data.train) > BPE_TRAIN_BYTES:
        log.info("BPE merges learned from the first %d MB of training text", BPE_TRAIN_BYTES >> 20)
    text = data.train[:BPE_TRAIN_BYTES].decode("utf-8", errors="replace")
    start = time.perf_counter()
    tok = HFTokenizer.train_bpe(text_chunks(text), vocab_size)
    log.info("trained a %d-token BPE in %.1f s", vocab_size, time.perf_counter() - start)
    return tok


def _choose(cfg: TrainConfig, data: TextData | TokenData, init: Tokenizer | None) -> Tokenizer:
    """The tokenizer `--tokenizer` names, before the agreement checks."""
    spec = cfg.tokenizer
    if spec == "bytes":
        return ByteTokenizer()
    if spec == "ids":
        return IdsTokenizer(cfg.model.vocab_size)
    if spec == "bpe":
        return _train_bpe(data, cfg.model.vocab_size)
    if spec != "auto":
        return HFTokenizer.from_file(spec)
    found = init or _data_tokenizer(data)
    if found is None and isinstance(data, TokenData):
        raise ConfigError(
            f"{data.source} holds token ids but no meta.json naming their tokenizer: pass "
            "--tokenizer PATH/tokenizer.json (the one that made them), or --tokenizer ids to "
            "train on the ids alone (no bits per byte, samples as numbers)"
        )
    return found or ByteTokenizer()


def _check_agrees(tok: Tokenizer, data: TextData | TokenData, init: InitSource | None) -> None:
    """Refuse a tokenizer other than the one the data or the initial weights were made with."""
    if tok.kind == "ids":
        return
    others = [("--init-from " + init.spec, init.tokenizer)] if init else []
    others.append((f"--data.path {data.source}", _data_tokenizer(data)))
    for where, other in others:
        if other is not None and _identity(other) != _identity(tok):
            raise ConfigError(
                f"{where} was made with {other.describe()}, but the run's tokenizer is "
                f"{tok.describe()}; data, weights and --tokenizer must share one: drop "
                "--tokenizer, or prepare the data again with isotrain prepare --tokenizer PATH"
            )


def _check_resume(tok: Tokenizer, run_dir: Path, spec: str) -> None:
    """A resumed run keeps the tokenizer it trained with (`spec`: the --tokenizer given)."""
    saved = run_dir / RUN_TOKENIZER
    before = HFTokenizer.from_file(saved) if saved.is_file() else None
    if (before.sha256 if before else "") != tok.sha256:
        was = before.describe() if before else "bytes or ids (no tokenizer.json)"
        drop = f"drop --tokenizer {spec} to continue it, or " if spec != "auto" else ""
        raise ConfigError(
            f"cannot resume {run_dir}: it trained with {was}, not {tok.describe()}; "
            f"{drop}{ways_on(run_dir)}"
        )


def resolve_tokenizer(
    cfg: TrainConfig,
    data: TextData | TokenData,
    *,
    init: InitSource | None = None,
    resuming: bool = False,
) -> Tokenizer:
    """The run's tokenizer (see NOTE [tokenizer resolution]); never one the data contradicts."""
    saved = Path(cfg.out_dir) / RUN_TOKENIZER
    if resuming and saved.is_file() and cfg.tokenizer in ("auto", "bpe"):
        tok: Tokenizer = HFTokenizer.from_file(saved)
    else:
        tok = _choose(cfg, data, init.tokenizer if init else None)
    _check_agrees(tok, data, init)
    if resuming:
        _check_resume(tok, Path(cfg.out_dir), cfg.tokenizer)
    if cfg.tokenizer_sha256 and tok.sha256 != cfg.tokenizer_sha256:
        raise ConfigError(
            f"--tokenizer-sha256 {cfg.tokenizer_sha256[:12]}… does not match "
            f"{tok.describe()}; pass the tokenizer it names, or drop --tokenizer-sha256"
        )
    return tok


# NOTE [vocabulary size]
# The model's vocabulary is the tokenizer's. `--model.vocab-size` left at its default (256,
# bytes) takes the size of the run's tokenizer: a tokenizer.json, a prepared folder's, the one
# of --init-from or of the run it resumes (an info line says so). A size given smaller than
# the tokenizer is refused; a larger one is kept (nanoGPT pads GPT-2's 50257 to 50304) with a
# warning once it exceeds the tokenizer rounded up to a multiple of 128, the usual padding.
VOCAB_PADDING = 128


def fit_vocab(cfg: TrainConfig, tok: Tokenizer) -> TrainConfig:
    """`cfg` with --model.vocab-size from the tokenizer when left at its default; a given
    size that is too small is refused, one far too large warned (NOTE [vocabulary size])."""
    given, need = cfg.model.vocab_size, tok.vocab_size
    if tok.kind == "ids" or given == need:
        return cfg
    if given == type(cfg.model)().vocab_size:
        log.info("--model.vocab-size %d: the size of %s", need, tok.describe())
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=need))
    if given < need:
        raise ConfigError(
            f"--model.vocab-size {given} is too small for {tok.describe()}; pass "
            f"--model.vocab-size {need}, or leave it out to take the tokenizer's"
        )
    if given > -(-need // VOCAB_PADDING) * VOCAB_PADDING:
        rows = (given - need) * cfg.model.d_model  # tied embedding and head: one matrix
        log.warning(
            "--model.vocab-size %d is larger than %s needs (%d): %d embedding rows (%s "
            "parameters) are never used; leave --model.vocab-size out to take the tokenizer's",
            given,
            tok.describe(),
            need,
            given - need,
            f"{rows:,}",
        )
    return cfg


def save_tokenizer(tok: Tokenizer, run_dir: str | Path) -> None:
    """Store an HF tokenizer as RUN/tokenizer.json (written whole, then renamed); for bytes and
    ids remove a stale one a failed earlier start may have left."""
    path = Path(run_dir) / RUN_TOKENIZER
    if not isinstance(tok, HFTokenizer):
        if path.is_symlink() or check_regular(path):  # a FIFO or directory is refused
            path.unlink()  # a link is removed, never what it points to
        return
    with writing(path, run_dir):
        make_dir(path.parent, follow=True)
        tok.save(path)


def load_inputs(
    cfg: TrainConfig, *, is_main: bool = True, origin: Mapping[str, str] | None = None
) -> tuple[TrainConfig, Corpus, Tokenizer, InitSource | None]:
    """Initial weights, data and tokenizer of a run, and its config with what they settle:
    the model shape of `--init-from` (`origin`: see `adopt_shape`) and the tokenizer's sha256."""
    init = read_init(cfg.init_from) if cfg.init_from else None
    if init is not None:
        cfg = validate(adopt_shape(cfg, init, origin=origin))
    d = cfg.data
    data = open_data(
        d.path,
        val_path=d.val_path,
        max_bytes=d.max_bytes,
        val_fraction=d.val_fraction,
        bin_dtype=d.bin_dtype,
    )
    resuming = bool(find_snapshots(cfg.out_dir))  # refused later if resuming is not allowed
    tok = resolve_tokenizer(cfg, data, init=init, resuming=resuming)
    if d.varlen and tok.kind != "bytes":
        raise ConfigError(
            f"--data.varlen splits documents at blank lines of byte data, not {tok.describe()}; "
            "drop --data.varlen or use --tokenizer bytes"
        )
    cfg = fit_vocab(dataclasses.replace(cfg, tokenizer_sha256=tok.sha256), tok)
    corpus = build_corpus(data, tok, cfg.model.vocab_size)
    if is_main and not resuming:
        save_tokenizer(tok, cfg.out_dir)
    return cfg, corpus, tok, init
