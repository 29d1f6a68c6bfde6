"""`isotrain sample | plot | report | export | prepare`: each command's options and wiring.

Each command parses its arguments before it imports what needs torch, so `--help` and an
argument error answer at once (NOTE [errors named, not imported] in `main`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from isotrain.train.cli.args import RunArgs, check_output, parse, run_of
from isotrain.train.config import ConfigError

if TYPE_CHECKING:  # at run time imported where raised: it imports torch
    from isotrain.train.rundir.writes import WriteError

__all__ = ["cmd_export", "cmd_plot", "cmd_prepare", "cmd_report", "cmd_sample", "tidy"]


def _write_failed(target: object, reason: str, code: int | None) -> WriteError:
    """What `train` says of a failed write, for the other commands: exit 1, one line."""
    from isotrain.train.rundir.writes import WriteError

    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = "make it writable or choose another --out"
    else:
        space = (None, errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        fix = "free some space" if code in space else "fix that"
    return WriteError(
        f"could not write {target}: {reason}; nothing half-written was left. Try to {fix}, "
        "then run the same command again"
    )


_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)  # only writes get these


def _is_write(e: OSError, folder: Path) -> bool:
    """A write into `folder` failed (not a missing input, not a read elsewhere)."""
    if e.errno in _WRITE_ERRNOS or (type(e) is OSError and e.errno is None):  # None: numpy's
        return True
    if e.errno not in (errno.EACCES, errno.EPERM, errno.EIO) or e.filename is None:
        return False
    path, root = Path(os.fsdecode(e.filename)).resolve(), folder.resolve()
    return path == root or root in path.parents


@contextlib.contextmanager
def _writing(target: Path, *, folder: Path | None = None) -> Iterator[None]:
    """A failed write into `folder` (default `target`) under the block, such as a read-only
    folder or a full disk, as one line; the command removes what it left half-written."""
    try:
        yield
    except OSError as e:
        if not _is_write(e, folder or target):
            raise
        reason = e.strerror or f"{e} (is the disk full?)"  # numpy: "N requested and M written"
        raise _write_failed(e.filename or target, reason, e.errno) from None
    except Exception as e:
        # safetensors: "Error while serializing: I/O error: REASON (os error N) at path ..."
        found = re.search(r"I/O error: (.*?) \(os error (\d+)\)", str(e))
        if type(e).__name__ != "SafetensorError" or found is None:
            raise
        raise _write_failed(target, found[1], int(found[2])) from None


@dataclass(frozen=True, kw_only=True)
class SampleArgs(RunArgs):
    """Generate text from a trained run, through the tokenizer it trained with.

    RUN: a run directory, a .safetensors file from `isotrain export`, or hf:FOLDER."""

    prompt: str = "def "
    """Text to continue."""
    prompt_file: str | None = None
    """Read the prompt from this UTF-8 file instead of --prompt."""
    tokens: int = 200
    """Number of tokens to generate."""
    temperature: float = 0.7
    """Sampling temperature; 0 picks the most likely token."""
    top_k: int | None = 50
    """Sample among the k most likely tokens (None: all)."""
    top_p: float | None = None
    """Sample among the most likely tokens whose probabilities sum to p (None: off)."""
    num_samples: int = 1
    """Number of samples, drawn as one batch."""
    seed: int = 0
    """Seed of the sampling generator (the global RNG is never touched)."""
    which: Literal["latest", "best"] = "latest"
    """Snapshot to load: the newest or the best-validation one."""
    max_whitespace: int = 64  # sampling.MAX_WHITESPACE (that module imports torch)
    """Longest run of whitespace (spaces, tabs, newlines) a sample writes: then the next token is
    text, so a run of spaces cannot spend the token budget (0: no limit)."""
    raw: bool = False
    """Print each sample as generated; by default trailing spaces are stripped from each line
    and blank lines beyond two in a row are left out (a note on stderr says when)."""


def tidy(text: str) -> str:
    """A sample as a reader wants it: no trailing spaces, no more than two blank lines in a row
    (the text after a longer run is kept), none at the end."""
    lines = [line.rstrip() for line in text.split("\n")]
    kept = [ln for i, ln in enumerate(lines) if ln or i < 2 or lines[i - 1] or lines[i - 2]]
    return "\n".join(kept).rstrip()


def cmd_sample(argv: Sequence[str]) -> int:
    a = parse(SampleArgs, argv, "isotrain sample")
    run = run_of(a, "isotrain sample")
    from isotrain.train.model.sampling import check_sampling, samples

    check_sampling(
        tokens=a.tokens,
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        num_samples=a.num_samples,
        max_whitespace=a.max_whitespace,
    )
    prompt = a.prompt
    if a.prompt_file is not None:
        path = Path(a.prompt_file).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--prompt-file {a.prompt_file}: no such file")
        prompt = path.read_text(encoding="utf-8")
    model, tok = _load(run, a.which)
    if tok is None:
        logging.getLogger(__name__).warning("%s has no tokenizer files: text is bytes", run)
    texts = samples(
        model,
        prompt,
        a.tokens,
        tokenizer=tok,
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        num_samples=a.num_samples,
        seed=a.seed,
        max_whitespace=a.max_whitespace,
    )
    full = [prompt + text for text in texts]
    shown = full if a.raw else [tidy(text) for text in full]
    for i, text in enumerate(shown):
        if len(texts) > 1:
            sys.stdout.write(f"--- sample {i + 1} of {len(texts)} ---\n")
        sys.stdout.write(text + "\n")
    if shown != full:
        sys.stderr.write(
            "(trailing spaces and blank lines beyond two in a row left out; --raw shows them)\n"
        )
    long = a.max_whitespace and re.compile(rf"\s{{{a.max_whitespace},}}")
    stopped = [i + 1 for i, text in enumerate(texts) if long and long.search(text)]
    if stopped:
        sys.stderr.write(
            f"(a run of {a.max_whitespace} whitespace characters was stopped in sample "
            f"{', '.join(map(str, stopped))}; --max-whitespace 0 lets it go on)\n"
        )
    return 0


def _load(source: str, which: str) -> Any:
    """Model and tokenizer to sample from; an unreadable export file is a user error (the
    checks before loading name what is wrong; what the library still finds is wrapped)."""
    from isotrain.train.data.sources import DataError
    from isotrain.train.weights.load import load_with_tokenizer

    if not source.endswith(".safetensors"):
        return load_with_tokenizer(source, which=which)
    from safetensors import SafetensorError

    try:
        return load_with_tokenizer(source, which=which)
    except (DataError, ConfigError, FileNotFoundError):
        raise
    except (SafetensorError, ValueError, TypeError, KeyError, RuntimeError, OSError) as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"{source}: not a readable isotrain export ({reason}); "
            "try a file written by isotrain export"
        ) from None


@dataclass(frozen=True, kw_only=True)
class PlotArgs(RunArgs):
    """Draw a run's loss (every skipped step marked), learning rate, tokens/s and gradient
    norm as PNG files."""

    out: str | None = None
    """Folder for the PNG files: OUT/<run name>/, so runs never overwrite each other's
    (default: the run directory itself)."""


def cmd_plot(argv: Sequence[str]) -> int:
    args = parse(PlotArgs, argv, "isotrain plot")
    from isotrain.train.report.plots import plot_run

    run = run_of(args, "isotrain plot")
    out = Path(args.out or run)
    check_output("--out", out, is_dir=True)
    with _writing(out):
        written = plot_run(run, args.out)
    for path in written:
        sys.stdout.write(f"wrote {path}\n")
    return 0


@dataclass(frozen=True, kw_only=True)
class ReportArgs(RunArgs):
    """Summarise a run: model, losses, throughput, skipped steps by reason, resumes."""


def cmd_report(argv: Sequence[str]) -> int:
    run = run_of(parse(ReportArgs, argv, "isotrain report"), "isotrain report")
    from rich.console import Console
    from rich.table import Table

    from isotrain.train.report.plots import summarize_run

    table = Table(title=f"isotrain report: {run}", show_header=False)
    for key, value in summarize_run(run).items():
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    Console(highlight=False).print(table)
    return 0


@dataclass(frozen=True, kw_only=True)
class ExportArgs(RunArgs):
    """Write a run's weights (and tokenizer) for use elsewhere."""

    out: str | None = None
    """Output: a .safetensors file (isotrain format; default RUN/model.safetensors) or a folder
    (hf format; default RUN/hf)."""
    format: Literal["isotrain", "hf"] = "isotrain"
    """isotrain: one .safetensors file `sample` and `--init-from` read; hf: a GPT-2 folder for
    transformers (config.json, model.safetensors, tokenizer files)."""
    which: Literal["latest", "best"] = "latest"
    """Snapshot to read: the newest or the best-validation one."""
    force: bool = False
    """Replace an existing --out (the default output inside the run is always rewritten)."""


def cmd_export(argv: Sequence[str]) -> int:
    a = parse(ExportArgs, argv, "isotrain export")
    from isotrain.train.weights.export import export_run

    run = run_of(a, "isotrain export")
    hf = a.format == "hf"
    target = Path(a.out or (f"{run}/hf" if hf else f"{run}/model.safetensors"))
    check_output("--out", target, is_dir=hf)
    if a.out is not None and target.exists() and not a.force:
        raise ConfigError(f"--out {a.out} exists; pass --force to replace it, or another --out")
    with _writing(target, folder=target if hf else target.parent):
        out, snap = export_run(run, target, which=a.which, fmt=a.format)
    sys.stdout.write(f"wrote {out} (weights of {snap.name})\n")
    return 0


@dataclass(frozen=True, kw_only=True)
class PrepareArgs:
    """Tokenize text into train.bin / val.bin (+ meta.json) for memory-mapped training."""

    input: tuple[str, ...]
    """Text files, folders or globs (quote them); .jsonl records; .json/.parquet need datasets."""
    out: str
    """Output folder; train with --data.path OUT."""
    val_input: str | None = None
    """Validation text (default: held out from the input, by file or from the tail)."""
    tokenizer: str = "bytes"
    """bytes | bpe (byte-level BPE learned from the training text) | PATH/tokenizer.json."""
    vocab_size: int = 1024
    """Tokens of the BPE to learn (--tokenizer bpe)."""
    val_fraction: float = 0.1
    """Share of the input held out for validation."""
    text_field: str = "text"
    """Field holding the text in .jsonl / .json / .parquet records."""
    bpe_train_bytes: int = 100_000_000
    """Learn BPE merges from at most this many bytes of training text."""
    overwrite: bool = False
    """Replace a folder's existing train.bin / val.bin."""
    progress: bool = True
    """Show progress bars."""


def cmd_prepare(argv: Sequence[str]) -> int:
    a = parse(PrepareArgs, argv, "isotrain prepare")
    from isotrain.train.data.prepare import prepare

    with _writing(Path(a.out)):
        meta = prepare(
            list(a.input),
            a.out,
            val_input=a.val_input,
            tokenizer=a.tokenizer,
            vocab_size=a.vocab_size,
            val_fraction=a.val_fraction,
            text_field=a.text_field,
            bpe_train_bytes=a.bpe_train_bytes,
            overwrite=a.overwrite,
            progress=a.progress,
        )
    splits = meta["splits"]
    sys.stdout.write(
        f"wrote {a.out}: {splits['train']['tokens']:,} train / {splits['val']['tokens']:,} val "
        f"tokens ({meta['dtype']}, tokenizer {meta['tokenizer']}); train with --data.path {a.out}\n"
    )
    return 0
