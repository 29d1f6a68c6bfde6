"""`isotrain train | sample | plot | report | export | prepare`: argument parsing and wiring only.

Flags come from the config dataclasses through tyro; precedence is
preset < `--config FILE.toml` < flags. User errors print one clear line and exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import tyro

from isotrain.train.config import PRESETS, ConfigError, TrainConfig, apply_toml, validate
from isotrain.train.data import DataError
from isotrain.train.rundir import WriteError
from isotrain.train.snapshot import SnapshotError

__all__ = ["main"]

USER_ERRORS = (ConfigError, DataError, SnapshotError, FileNotFoundError)
# Optional packages and the extra that installs each: a missing one is a user error too.
EXTRAS = {"matplotlib": "plots", "tensorboard": "tensorboard", "safetensors": "export"}
T = TypeVar("T")


def _one_line(box: str) -> str:
    """tyro's error message as one line: the title (first line), frames, rules and help
    pointers dropped. Handles the framed (terminal) and the plain (captured) layout."""
    lines = [
        ln.strip().strip("│┃|").strip() for ln in re.sub(r"\x1b\[[0-9;]*m", "", box).splitlines()
    ]
    lines = [ln for ln in lines if ln and not set(ln) <= set("─━-=+╭╮╰╯ ")][1:]
    words = []
    for line in lines:
        if line.startswith(("For full helptext", "Argument helptext")):
            break
        words.append(line)
    return " ".join(words) or "invalid arguments"


def parse(cls: type[T], argv: Sequence[str], prog: str, **kwargs: Any) -> T:
    """`tyro.cli`, with a parse error turned into a one-line ConfigError (`--help` unchanged)."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            args = tyro.cli(cls, args=list(argv), prog=prog, **kwargs)
    except SystemExit as e:
        if e.code:
            reason = _one_line(captured.getvalue()).rstrip(".")
            raise ConfigError(f"{reason}; try {prog} --help") from None
        sys.stderr.write(captured.getvalue())
        raise
    sys.stderr.write(captured.getvalue())  # warnings of a successful parse
    return args


def check_output(option: str, path: Path, *, is_dir: bool) -> None:
    """Refuse an output path that cannot be written: a directory where a file goes (or the
    reverse), or a path under a file."""
    for at in (path, *path.parents):
        if at.exists():
            if at == path and at.is_dir() != is_dir:
                kind = "a directory" if at.is_dir() else "a file"
                raise ConfigError(f"{option} {path} is {kind}; try another {option}")
            if at != path and not at.is_dir():
                raise ConfigError(f"{option} {path} lies under the file {at}; try another {option}")
            return


def parse_train_args(argv: Sequence[str]) -> TrainConfig:
    """Resolve preset, TOML file and flags into one TrainConfig."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(list(argv))
    cfg = PRESETS[known.preset]()
    if known.config:
        cfg = apply_toml(cfg, known.config)
    desc = (
        "Train the GPT. Presets: " + ", ".join(sorted(PRESETS)) + " (--preset NAME, default "
        "tiny); --config FILE.toml overlays a TOML file; flags override both."
    )
    return parse(TrainConfig, rest, "isotrain train", default=cfg, description=desc)


def cmd_train(argv: Sequence[str]) -> int:
    from isotrain.train.loop import train

    cfg = parse_train_args(argv)
    train(validate(cfg))
    return 0


@dataclass(frozen=True, kw_only=True)
class SampleArgs:
    """Generate text from a trained run, through the tokenizer it trained with."""

    run: str
    """Run directory holding snapshots, a .safetensors file from `isotrain export`, or hf:FOLDER."""
    prompt: str = "def "
    """Text to continue."""
    prompt_file: str | None = None
    """Read the prompt from this UTF-8 file instead of --prompt."""
    tokens: int = 200
    """Number of tokens to generate."""
    temperature: float = 0.8
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


def cmd_sample(argv: Sequence[str]) -> int:
    from isotrain.train.sampling import check_sampling, samples

    a = parse(SampleArgs, argv, "isotrain sample")
    check_sampling(
        tokens=a.tokens,
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        num_samples=a.num_samples,
    )
    prompt = a.prompt
    if a.prompt_file is not None:
        path = Path(a.prompt_file).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--prompt-file {a.prompt_file}: no such file")
        prompt = path.read_text(encoding="utf-8")
    model, tok = _load(a.run, a.which)
    if tok is None:
        logging.getLogger(__name__).warning("%s has no tokenizer files: text is bytes", a.run)
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
    )
    for i, text in enumerate(texts):
        if len(texts) > 1:
            sys.stdout.write(f"--- sample {i + 1} of {len(texts)} ---\n")
        sys.stdout.write(prompt + text + "\n")
    return 0


def _load(source: str, which: str) -> Any:
    """Model and tokenizer to sample from; an unreadable export file is a user error."""
    from safetensors import SafetensorError

    from isotrain.train.weights import load_with_tokenizer

    if not source.endswith(".safetensors"):
        return load_with_tokenizer(source, which=which)
    try:
        return load_with_tokenizer(source, which=which)
    except (SafetensorError, ValueError, TypeError, KeyError, RuntimeError, OSError) as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"--run {source}: not a readable isotrain export ({reason}); "
            "try a file written by isotrain export"
        ) from None


@dataclass(frozen=True, kw_only=True)
class RunArgs:
    """A run directory to read."""

    run: str
    """Run directory (from `isotrain train --out-dir`)."""
    out: str | None = None
    """Output directory for plot (default: the run)."""


def cmd_plot(argv: Sequence[str]) -> int:
    from isotrain.train.plots import plot_run

    args = parse(RunArgs, argv, "isotrain plot")
    check_output("--out", Path(args.out or args.run), is_dir=True)
    for path in plot_run(args.run, args.out):
        sys.stdout.write(f"wrote {path}\n")
    return 0


def cmd_report(argv: Sequence[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    from isotrain.train.plots import summarize_run

    args = parse(RunArgs, argv, "isotrain report")
    table = Table(title=f"isotrain report: {args.run}", show_header=False)
    for key, value in summarize_run(args.run).items():
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    Console(highlight=False).print(table)
    return 0


@dataclass(frozen=True, kw_only=True)
class ExportArgs:
    """Write a run's weights (and tokenizer) for use elsewhere."""

    run: str
    """Run directory (from `isotrain train --out-dir`)."""
    out: str | None = None
    """Output: a .safetensors file (isotrain format; default RUN/model.safetensors) or a folder
    (hf format; default RUN/hf)."""
    format: Literal["isotrain", "hf"] = "isotrain"
    """isotrain: one .safetensors file `sample` and `--init-from` read; hf: a GPT-2 folder for
    transformers (config.json, model.safetensors, tokenizer files)."""
    which: Literal["latest", "best"] = "latest"
    """Snapshot to read: the newest or the best-validation one."""


def cmd_export(argv: Sequence[str]) -> int:
    from isotrain.train.export import export_run

    a = parse(ExportArgs, argv, "isotrain export")
    hf = a.format == "hf"
    target = Path(a.out or (f"{a.run}/hf" if hf else f"{a.run}/model.safetensors"))
    check_output("--out", target, is_dir=hf)
    out, snap = export_run(a.run, target, which=a.which, fmt=a.format)
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
    from isotrain.train.prepare import prepare

    a = tyro.cli(PrepareArgs, args=list(argv), prog="isotrain prepare")
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


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "train": cmd_train,
    "sample": cmd_sample,
    "plot": cmd_plot,
    "report": cmd_report,
    "export": cmd_export,
    "prepare": cmd_prepare,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `isotrain` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: isotrain {" + ",".join(COMMANDS) + "} [--help] [options]"
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(usage + "\n")
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        sys.stderr.write(f"isotrain: unknown command {argv[0]!r}\n{usage}\n")
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[argv[0]](argv[1:])
    except USER_ERRORS as e:
        sys.stderr.write(f"isotrain {argv[0]}: error: {e}\n")
        return 2
    except WriteError as e:  # the machine, not the command: exit 1
        sys.stderr.write(f"isotrain {argv[0]}: error: {e}\n")
        return 1
    except ImportError as e:
        extra = EXTRAS.get((e.name or getattr(e.__cause__, "name", None) or "").split(".")[0])
        if extra is None:
            raise
        fix = "" if "pip install" in str(e) else f"; try pip install 'isotrain[{extra}]'"
        sys.stderr.write(f"isotrain {argv[0]}: error: {e}{fix}\n")
        return 2
