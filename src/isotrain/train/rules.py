"""The rules a trainer config must satisfy: each field's range, the ties between fields, the
inputs to start from, and what the machine must offer.

`validate` raises a `ConfigError` naming the flag, the bad value and the fix (the flag with its
default). `RULES` is read by the weights' shape checks too.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from pathlib import Path
from typing import Any

from isotrain.train.config import TrainConfig
from isotrain.train.environment import (
    check_cpu_kind,
    check_device,
    check_directory,
    check_extra,
)
from isotrain.train.fields import ConfigError, check_types, flag_value

__all__ = ["COMPILE_MODES", "RULES", "TOKENIZER_KINDS", "validate", "validate_inputs"]


def _positive(v: Any) -> bool:
    return bool(v > 0)


def _at_least_0(v: Any) -> bool:
    return bool(v >= 0)


def _unit(v: Any) -> bool:
    return bool(0.0 <= v < 1.0)


COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

# Each field's own range: dotted path -> (accepts the value, the rule in words).
RULES: dict[str, tuple[Callable[[Any], bool], str] | tuple[Callable[[Any], bool], str, str]] = {
    **dict.fromkeys(
        (
            *("model.n_layer", "model.n_head", "model.d_model", "model.block_size"),
            *("model.vocab_size", "data.batch_size", "data.max_bytes", "steps", "grad_accum"),
            *("eval_every", "eval_batches", "log_every"),
            *("guard.rollback_check_every", "guard.rollback_copy_every"),
        ),
        (_positive, "it must be a positive integer"),
    ),
    **dict.fromkeys(
        ("optim.warmup_steps", "optim.weight_decay", "sample_tokens", "snapshot.minutes"),
        (_at_least_0, "use 0 or more"),
    ),
    **dict.fromkeys(
        ("guard.rollback_after", "guard.spike_k"), (_at_least_0, "use 0 (off) or more")
    ),
    **dict.fromkeys(
        ("model.dropout", "optim.beta1", "optim.beta2", "optim.muon_momentum"),
        (_unit, "use [0, 1)"),
    ),
    "data.val_fraction": (lambda v: 0.0 < v < 1.0, "use a value in (0, 1)"),
    "optim.lr": (_positive, "the learning rate must be positive"),
    "precision_probe_seconds": (_positive, "the probe needs a positive number of seconds"),
    "optim.grad_clip": (_at_least_0, "use 0 (off) or a positive norm"),
    "snapshot.keep": (lambda v: v >= 1, "keep at least 1"),
    "doctor.every": (_at_least_0, "use 0 (off) or a positive number of steps"),
    "snapshot.every": (lambda v: v is None or v >= 0, "use None (at every evaluation), 0 or more"),
    "quant.bits": (lambda v: 0 <= v <= 16, "use 0 (off) or 1..16"),
    "guard.spike_window": (lambda v: v >= 2, "use 2 or more"),
    "guard.inject_nan_at": (
        lambda v: all(s >= 1 for s in v),
        "steps are numbered from 1",
        "--guard.inject-nan-at 3 (or leave it out)",
    ),
    "seed": (lambda v: 0 <= v < 2**63, "use 0 to 2**63 - 1"),
    "compile.mode": (lambda v: v in COMPILE_MODES, f"use one of {COMPILE_MODES[1:]}"),
}


def _check(ok: bool, path: str, value: Any, rule: str, fix: str | None = None) -> None:
    """Raise `--flag VALUE is invalid: RULE; try FIX` (FIX: the flag with its default)."""
    if not ok:
        fix = fix or flag_value(path, operator.attrgetter(path)(TrainConfig()))
        raise ConfigError(f"{flag_value(path, value)} is invalid: {rule}; try {fix}")


def _check_relations(cfg: TrainConfig) -> None:
    """Rules that tie one field to another."""
    m, d, o = cfg.model, cfg.data, cfg.optim
    _check(
        m.d_model % m.n_head == 0,
        "model.d_model",
        m.d_model,
        f"it must be divisible by --model.n-head ({m.n_head})",
        f"--model.d-model {m.n_head * 32}",
    )
    _check(
        o.name != "muon" or cfg.parallel.mode != "fsdp",
        "optim.name",
        o.name,
        "Muon orthogonalises whole matrices, which FSDP shards across ranks; use "
        "--parallel.mode ddp",
        "--optim.name adamw",
    )
    _check(
        o.min_lr <= o.lr,
        "optim.min_lr",
        o.min_lr,
        "use 0 <= min_lr <= lr",
        f"--optim.min-lr {o.lr / 10:g}",
    )
    _check(
        all(0 < b <= m.block_size for b in d.buckets),
        "data.buckets",
        d.buckets,
        f"every bucket must be in 1..--model.block-size ({m.block_size})",
        f"--data.buckets {m.block_size // 2} {m.block_size}",
    )
    _check(
        list(d.buckets) == sorted(set(d.buckets)),
        "data.buckets",
        d.buckets,
        "list the lengths in increasing order, without repeats",
        flag_value("data.buckets", sorted(set(d.buckets))),
    )
    from isotrain.checkpointing import parse_policy  # torch: only once the flags parsed

    try:
        parse_policy(cfg.checkpointing.policy)
    except ValueError as e:
        raise ConfigError(
            f"--checkpointing.policy {cfg.checkpointing.policy!r} is invalid: {e}; "
            "try --checkpointing.policy full"
        ) from None


def _check_environment(cfg: TrainConfig) -> None:
    """What the machine must offer: the device, the run directory, optional packages."""
    check_device(cfg.device)
    check_cpu_kind()
    check_directory("--out-dir", cfg.out_dir)
    check_directory("--resume", cfg.resume)
    for name in ("tensorboard", "wandb"):
        if name in cfg.report.loggers:
            check_extra(name, f"--report.loggers {name}", name)


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check every field that can be wrong on its own or in combination; return cfg unchanged.

    Types come from the annotations (`fields.check_types`), ranges from `RULES`.
    """
    check_types(cfg)
    for path, (ok, rule, *fix) in RULES.items():
        value = operator.attrgetter(path)(cfg)
        _check(ok(value), path, value, rule, *fix)
    _check_relations(cfg)
    validate_inputs(cfg)
    _check_environment(cfg)
    return cfg


TOKENIZER_KINDS = ("auto", "bytes", "bpe", "ids")


def validate_inputs(cfg: TrainConfig) -> None:
    """Check the tokenizer, --init-from and --resume settings (data and weights to start from)."""
    tok, init = cfg.tokenizer, cfg.init_from
    _check(
        tok in TOKENIZER_KINDS or Path(tok).expanduser().is_file(),
        "tokenizer",
        tok,
        "use auto, bytes, bpe, ids or the path of a tokenizer.json (no such file)",
    )
    _check(
        tok != "bpe" or cfg.model.vocab_size > 256,
        "model.vocab_size",
        cfg.model.vocab_size,
        "--tokenizer bpe trains that many tokens (256 bytes plus merges); try 1024",
    )
    _check(
        not cfg.data.varlen or tok in ("auto", "bytes"),
        "data.varlen",
        True,
        "documents are split at blank lines of byte data; drop it or use --tokenizer bytes",
    )
    sha = cfg.tokenizer_sha256
    _check(
        sha == "" or (len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)),
        "tokenizer_sha256",
        sha,
        "use '' (any) or 64 lowercase hex digits",
    )
    _check(
        init is None
        or init.startswith("hf:")
        or init.endswith(".safetensors")
        or Path(init).is_dir(),
        "init_from",
        init,
        "use a run directory, a .safetensors file or hf:FOLDER (no such directory)",
    )
    if cfg.resume is not None and Path(cfg.resume).is_file():
        raise ConfigError(
            f"--resume {cfg.resume} is a file: --resume continues a run directory; to start a "
            f"new run from these weights, pass --init-from {cfg.resume}"
        )
