"""`isotrain train | sample | plot | report | export | prepare`: argument parsing and wiring only.

Flags come from the config dataclasses through tyro; precedence is
preset < `--config FILE.toml` < flags. User errors print one clear line and exit 2; a run
stopped by Ctrl-C or SIGTERM exits 130 or 143 after its snapshot.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from isotrain.train.cli.args import parse
from isotrain.train.cli.commands import cmd_export, cmd_plot, cmd_prepare, cmd_report, cmd_sample
from isotrain.train.cli.flags import options
from isotrain.train.cli.launch import launch, nproc_per_node, tell_launcher
from isotrain.train.config import PRESETS, ConfigError, TrainConfig, apply_toml
from isotrain.train.environment import install_hint
from isotrain.train.fields import leaves
from isotrain.train.rules import validate

__all__ = ["main", "parse_train_args"]

DEFAULT_OUT = TrainConfig().out_dir
# NOTE [errors named, not imported]
# This module imports no torch, so that --help, --version and argument errors answer at once
# (tests/train/test_cli.py holds it). The errors a command may raise live in modules that do
# import torch; an exception can only be raised once its class's module is imported, so the
# classes are looked up in sys.modules after the fact (`_raised`) rather than imported here.
USER_ERRORS = (
    ("isotrain.train.data.sources", "DataError"),
    ("isotrain.train.rundir.integrity", "SnapshotError"),
)
WRITE_ERROR = ("isotrain.train.rundir.writes", "WriteError")
# Optional packages and the extra that installs each: a missing one is a user error too.
EXTRAS = {
    "matplotlib": "plots",
    "tensorboard": "tensorboard",
    "safetensors": "export",
    "tokenizers": "data",
    "wandb": "wandb",
}


def _option(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """The value of `--name VALUE` / `--name=VALUE` (the last one wins), and argv without it."""
    value, rest, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == name:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError(f"{name} needs a value; try isotrain train --help")
            value, i = argv[i + 1], i + 2
            continue
        if arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return value, rest


def _split_commas(argv: list[str], name: str) -> list[str]:
    """`--report.loggers jsonl,csv` as `--report.loggers jsonl csv` (both forms work)."""
    out: list[str] = []
    inside = False
    for arg in argv:
        if arg.startswith(name + "="):
            out += [name, *filter(None, arg.split("=", 1)[1].split(","))]
            inside = True
            continue
        inside = arg == name or (inside and not arg.startswith("-"))
        out += [*filter(None, arg.split(","))] if inside and arg != name else [arg]
    return out


def parse_train_args(argv: Sequence[str]) -> TrainConfig:
    """Resolve preset, TOML file and flags into one TrainConfig."""
    return _resolve(argv)[0]


def _resolve(argv: Sequence[str]) -> tuple[TrainConfig, dict[str, str]]:
    """The config of a command line, and where each setting off the default came from
    (`--preset smoke`, `--config FILE`, or `flag`), for the run header."""
    preset, rest = _option(list(argv), "--preset")
    config, rest = _option(rest, "--config")
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"--preset {preset!r} is not a preset; try one of {', '.join(PRESETS)}")
    stages = [(TrainConfig(), ""), (PRESETS[preset or "tiny"](), f"--preset {preset}")]
    if config:
        stages.append((apply_toml(stages[-1][0], config), f"--config {config}"))
    cfg = stages[-1][0]
    if any(a in ("-h", "--help", "--help-all") for a in rest):
        _train_help(cfg, rest)
    rest = _split_commas(rest, "--report.loggers")
    cfg = parse(TrainConfig, rest, "isotrain train", default=cfg, description=TRAIN_DESCRIPTION)
    stages.append((cfg, "flag"))
    origin: dict[str, str] = {}
    for (before, _), (after, source) in itertools.pairwise(stages):
        old = leaves(before)
        origin.update({k: source for k, v in leaves(after).items() if v != old[k]})
    table, _ = options(TrainConfig)
    for word in rest:  # a flag passed counts as passed, even where it repeats the preset
        if word.split("=", 1)[0] in table:
            origin[table[word.split("=", 1)[0]].path] = "flag"
    return cfg, origin


TRAIN_DESCRIPTION = (
    "Train the GPT. --preset NAME (" + ", ".join(PRESETS) + "; default tiny) is the starting "
    "point; --config FILE.toml overlays a TOML file (a run's OUT_DIR/config.toml works); "
    "flags override both."
)


def _train_help(cfg: TrainConfig, argv: list[str]) -> None:
    """`--help` (short), `--help SECTION`, `--help presets`, `--help-all`; then exit 0."""
    from isotrain.train.cli.helptext import PAGES, all_help, section_help, short_help

    if "--help-all" in argv:
        sys.stdout.write(all_help(cfg) + "\n")
        raise SystemExit(0)
    flag_at = max(i for i, a in enumerate(argv) if a in ("-h", "--help"))
    section = argv[flag_at + 1] if flag_at + 1 < len(argv) else None
    if section is not None and not section.startswith("-"):
        if section not in PAGES:
            raise ConfigError(f"--help {section}: no such section; try one of {', '.join(PAGES)}")
        sys.stdout.write(section_help(cfg, section) + "\n")
    else:
        sys.stdout.write(short_help(cfg) + "\n")
    raise SystemExit(0)


def cmd_doctor(argv: Sequence[str]) -> int:
    from isotrain.train.cli.doctor import cmd_doctor as run

    return run(argv)


# NOTE [default run directory]
# A command without --out-dir (or --resume) trains into runs/default. When runs/default holds
# a run with another shape, data, tokenizer, seed, --init-from or parallel mode (read from its
# config.toml), the command describes a new run, not that one: it is refused in one line that
# names the differences and a fresh directory named after the new run (`--out-dir runs/smoke`),
# before anything is loaded. The same command again continues the run; once it made its
# --steps, it says the run is complete and prints the next commands (exit 0).


def _named_out_dir(argv: Sequence[str]) -> bool:
    """True when the command names its run directory (a flag, or the --config file's)."""
    names = ("--out-dir", "--resume")
    if any(a in names or a.startswith(tuple(n + "=" for n in names)) for a in argv):
        return True
    config, _ = _option(list(argv), "--config")
    return config is not None and apply_toml(TrainConfig(), config).out_dir != DEFAULT_OUT


def _new_run_name(argv: Sequence[str], cfg: TrainConfig) -> str:
    """A fresh run directory named after what the command trains (preset, data, weights)."""
    preset, _ = _option(list(argv), "--preset")
    stems = [
        Path(source.removeprefix("hf:").rstrip("/*")).name.split(".")[0]
        for source in (cfg.init_from, cfg.data.path)
        if source
    ]
    mode = [cfg.parallel.mode] if cfg.parallel.mode != "none" else []
    parts = [p for p in (preset, *stems, *mode) if p]
    base = Path("runs") / "-".join(parts or ["tiny"])
    out, n = base, 2
    while out.exists():
        out, n = base.with_name(f"{base.name}-{n}"), n + 1
    return str(out)


def cmd_train(argv: Sequence[str]) -> int:
    nproc, argv = nproc_per_node(argv)
    cfg, origin = _resolve(argv)
    validate(cfg)
    from isotrain.train.loop import TrainingStopped, train  # torch: once the flags are good
    from isotrain.train.report.progress import where_and_next
    from isotrain.train.rundir.resume import RunComplete, changes_in_words, other_run
    from isotrain.train.watch import Diverged

    if nproc is not None and cfg.parallel.mode == "none":
        raise ConfigError(
            f"--nproc-per-node {nproc} trains one model in {nproc} processes: pass "
            "--parallel.mode ddp (or fsdp)"
        )
    if not _named_out_dir(argv):
        differs = other_run(cfg.out_dir, cfg)
        if differs:
            raise ConfigError(
                f"{cfg.out_dir} holds another run ({changes_in_words(differs)}), so this "
                f"command is a new run: pass --out-dir {_new_run_name(argv, cfg)} (or any new "
                "directory)"
            )
    if nproc is not None:
        return launch(nproc, argv)
    try:
        train(cfg, origin=origin)
    except TrainingStopped as e:  # every rank stops alike: rank 0 says it
        if _is_rank0():
            sys.stderr.write(f"isotrain train: {e}\n")
        return 128 + e.signum
    except Diverged as e:  # every rank's monitor saw it: rank 0 says it
        _say(f"isotrain train: error: {e}", everywhere=False)
        return 1
    except RunComplete as e:
        if _is_rank0():
            lines = where_and_next(e.run_dir, cfg.report.loggers)
            sys.stdout.write(f"isotrain train: {e}\n" + "".join(ln + "\n" for ln in lines))
    return 0


def _say(line: str, *, everywhere: bool) -> None:
    """Print a user error once: in a torchrun worker it also goes to torchrun's error file, and
    the launcher of `--nproc-per-node` prints it instead of the workers."""
    if tell_launcher(line):
        return
    if everywhere or _is_rank0():
        sys.stderr.write(line + "\n")


def _is_rank0() -> bool:
    """False in a torchrun worker other than rank 0, which leaves messages to rank 0."""
    return os.environ.get("RANK", "0") == "0"


COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "train": (cmd_train, "train the GPT (--preset, --config FILE.toml, flags)"),
    "sample": (cmd_sample, "generate text from a run, an export or hf:FOLDER"),
    "plot": (cmd_plot, "draw loss (skips marked), lr, tokens/s, grad norm as PNGs"),
    "report": (cmd_report, "summarise a run: losses, speed, skipped steps by reason"),
    "export": (cmd_export, "write weights as .safetensors or a Hugging Face folder"),
    "prepare": (cmd_prepare, "tokenize a corpus into train.bin / val.bin"),
    "doctor": (cmd_doctor, "find hidden side effects in a training step (FILE.py, --trainer)"),
}


def _version() -> str:
    """Both versions, torch's from its metadata: importing it would take seconds."""
    from importlib.metadata import PackageNotFoundError, version

    from isotrain import __version__

    try:
        torch = version("torch")
    except PackageNotFoundError:
        torch = "not installed"
    return f"isotrain {__version__} (torch {torch})"


def _raised(e: BaseException, *kinds: tuple[str, str]) -> bool:
    """`e` is one of `kinds` (module, class name), imported or not (NOTE [errors named, not
    imported])."""
    mods = ((sys.modules.get(module), name) for module, name in kinds)
    return any(mod is not None and isinstance(e, getattr(mod, name)) for mod, name in mods)


def _help() -> str:
    lines = [
        "usage: isotrain COMMAND [--help] [options]",
        "",
        "Train a small GPT with isotrain's patterns, then sample, plot, report and export it.",
        "",
        "commands:",
        *(f"  {name:<9} {line}" for name, (_, line) in COMMANDS.items()),
        "",
        "options:",
        "  -h, --help   show this help; isotrain COMMAND --help shows a command's options",
        "  --version    show the versions of isotrain and torch",
    ]
    return "\n".join(lines) + "\n"


def _missing_extra(e: ImportError) -> str | None:
    """One line for an optional package that is not installed, naming the extra to install."""
    name = e.name or getattr(e.__cause__, "name", None) or ""
    extra = EXTRAS.get(name.split(".")[0])
    if extra is None:
        return None
    what = re.split(r"[:;,]?\s*(?:try )?pip install", str(e))[0].strip().rstrip(":;,")
    return f"{what}; try {install_hint(extra)}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `isotrain` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        (sys.stdout if argv else sys.stderr).write(_help())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        sys.stdout.write(_version() + "\n")
        return 0
    if argv[0] not in COMMANDS:
        sys.stderr.write(f"isotrain: error: unknown command {argv[0]!r}; try isotrain --help\n")
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[argv[0]][0](argv[1:])
    except (ConfigError, FileNotFoundError) as e:  # alike on every rank: rank 0 says it
        _say(f"isotrain {argv[0]}: error: {e}", everywhere=not isinstance(e, ConfigError))
        return 2
    except Exception as e:
        if _raised(e, *USER_ERRORS):  # the data or a snapshot, on any rank: each says it
            _say(f"isotrain {argv[0]}: error: {e}", everywhere=True)
            return 2
        if _raised(e, WRITE_ERROR):  # the machine, not the command: exit 1
            _say(f"isotrain {argv[0]}: error: {e}", everywhere=True)
            return 1
        message = _missing_extra(e) if isinstance(e, ImportError) else None
        if message is None:
            raise
        _say(f"isotrain {argv[0]}: error: {message}", everywhere=False)  # alike on every rank
        return 2
    except KeyboardInterrupt as e:  # before training started, or a second signal (StopNow)
        signum = getattr(e, "signum", signal.SIGINT)
        sys.stderr.write(f"isotrain {argv[0]}: interrupted ({signal.Signals(signum).name})\n")
        return 128 + signum
