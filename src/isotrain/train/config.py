"""Trainer configuration: frozen dataclasses (the single source of truth), presets, TOML.

Every field carries its help text as an attribute docstring; tyro turns each field into a CLI
flag (`--model.d-model 256`). Precedence: preset < TOML file < flags. The rules a finished
config must satisfy live in `rules.py`.
"""

from __future__ import annotations

import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from isotrain.train.fields import ConfigError, flag, overlay
from isotrain.train.model.shape import GPTConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = [
    "PRESETS",
    "CheckpointingConfig",
    "CompileConfig",
    "ConfigError",
    "DataConfig",
    "DoctorConfig",
    "GuardConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "QuantConfig",
    "ReportConfig",
    "SnapshotConfig",
    "TrainConfig",
    "apply_toml",
    "flag",
]


# The model section of the config is the model's own config: one definition, one set of help.
ModelConfig = GPTConfig


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where tokens come from and how batches are drawn."""

    path: str | None = None
    """Text (a file, a folder, a glob), a .bin/.npy token array, or a folder with train.bin and
    val.bin (isotrain prepare's or nanoGPT's); None uses the stdlib corpus."""
    max_bytes: int = 4_000_000
    """Byte budget of the default stdlib corpus (text from --data.path is read whole)."""
    val_fraction: float = 0.1
    """Share of the data held out for validation (by file for folders of several files)."""
    bin_dtype: Literal["uint8", "uint16", "uint32"] = "uint16"
    """Element type of a raw .bin token file without meta.json (.npy files carry their own)."""
    batch_size: int = 16
    """Sequences per micro-batch on each rank."""
    varlen: bool = False
    """Variable-length mode: whole documents (text between blank lines), padded to buckets."""
    buckets: tuple[int, ...] = ()
    """Bucket lengths for --data.varlen (empty: powers of two from 16 up to the block size)."""
    val_path: str | None = None
    """Validation data in the same form as --data.path (default: held out from --data.path)."""


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """The optimizer and the learning-rate schedule."""

    name: Literal["adamw", "muon"] = "adamw"
    """adamw: AdamW on every parameter; muon: torch.optim.Muon on the blocks' 2-D matrices
    (its step scaled to AdamW's RMS, so --optim.lr serves both) and AdamW on embeddings, head,
    norms and biases (one optimizer object: the guard, snapshots and schedule see both)."""
    lr: float = 4e-3
    """Peak learning rate after warmup."""
    min_lr: float = 2e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 50
    """Steps of linear warmup from 0 to lr."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (never on biases, norms)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    muon_momentum: float = 0.95
    """Muon's Nesterov momentum (--optim.name muon)."""


@dataclass(frozen=True, kw_only=True)
class CheckpointingConfig:
    """Activation checkpointing (isotrain.checkpointing)."""

    policy: str = "none"
    """none | full | every:K | selective | budget:BYTES (e.g. budget:200MB)."""


@dataclass(frozen=True, kw_only=True)
class CompileConfig:
    """torch.compile (isotrain.compile)."""

    enabled: bool = False
    """Compile the model; falls back to eager with one warning where compiling is impossible."""
    mode: str | None = None
    """torch.compile mode: None, default, reduce-overhead, max-autotune."""
    regional: bool = True
    """Compile each block in place (fast warm-up) instead of the whole model."""
    backend: str = "inductor"
    """torch.compile backend (inductor, aot_eager, eager)."""
    fail_on_recompile: bool = False
    """After warm-up, raise on any recompilation instead of silently recompiling."""


@dataclass(frozen=True, kw_only=True)
class GuardConfig:
    """Non-finite and spike guard (isotrain.guard)."""

    enabled: bool = True
    """Skip updates whose loss or gradient is non-finite or spikes, without host syncs."""
    spike_k: float = 6.0
    """Skip when loss or grad norm exceeds mean + k * std of the recent window (0 disables)."""
    spike_window: int = 128
    """Number of recent applied steps in the spike window."""
    rollback_after: int = 0
    """Roll back to the last good copy after this many consecutive skips (0 disables)."""
    rollback_check_every: int = 10
    """Read the skip counters for a rollback decision every N steps (a host sync on GPUs)."""
    rollback_copy_every: int = 100
    """Refresh the last good copy after this many applied steps (at a check with no skip)."""
    inject_nan_at: tuple[int, ...] = ()
    """Fault injection: make the loss NaN at these steps (numbered as in the logs, from 1)."""


@dataclass(frozen=True, kw_only=True)
class QuantConfig:
    """Quantization-aware training through straight-through estimators (isotrain.autograd)."""

    bits: int = 0
    """Fake-quantize Linear weights to this many bits (0 = full precision)."""
    activations: bool = False
    """Also fake-quantize the inputs of Linear layers."""


@dataclass(frozen=True, kw_only=True)
class SnapshotConfig:
    """Resumable snapshots of the whole training state."""

    every: int | None = None
    """Write a snapshot every N steps (None: at every evaluation; 0: only at the end)."""
    minutes: float = 5.0
    """Also write one once this many minutes passed since the last (0: off), so a crash
    loses at most that much."""
    keep: int = 2
    """Keep the last K periodic snapshots (plus the best-validation one)."""


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Distributed training under torchrun."""

    mode: Literal["none", "ddp", "fsdp"] = "none"
    """none (one process), ddp, or fsdp (FSDP2); ddp/fsdp run in several processes:
    --nproc-per-node N on one machine, or torchrun -m isotrain train."""


@dataclass(frozen=True, kw_only=True)
class DoctorConfig:
    """The doctor during the run (isotrain.doctor). Under torchrun the ranks are compared
    before the first step; a Monitor checks cheap invariants every N steps."""

    every: int = 10
    """Check every N steps that the replicas agree across ranks, the update was applied alike,
    parameters still change, nothing is NaN and the learning rate is on its schedule (0: off;
    under 0.1% of a tiny-preset step at 10, benchmarks/bench_monitor.py). A divergence stops
    the run: its newest snapshot (checked at its step) is the last consistent one."""


LoggerName = Literal["jsonl", "csv", "tensorboard", "wandb"]


@dataclass(frozen=True, kw_only=True)
class ReportConfig:
    """Where the run's records go."""

    loggers: tuple[LoggerName, ...] = ("jsonl",)
    """jsonl (OUT_DIR/metrics.jsonl, always written), csv (OUT_DIR/csv/), tensorboard
    (OUT_DIR/tensorboard, isotrain[tensorboard]), wandb (OUT_DIR/wandb, isotrain[wandb];
    WANDB_MODE=offline needs no network). Several: --report.loggers jsonl csv."""
    wandb_project: str = "isotrain"
    """Weights & Biases project of --report.loggers wandb."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything a training run needs; stored in every snapshot and metrics file."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    doctor: DoctorConfig = field(default_factory=DoctorConfig)
    steps: int = 1000
    """Optimizer steps to train for."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    eval_every: int = 500
    """Evaluate on the validation split every N steps (and at the end)."""
    eval_batches: int = 256
    """Most validation batches per evaluation: every non-overlapping window of the split once
    where they fit (the exact loss; ~210 batches for the default corpus), else this many
    batches of evenly spread windows. The same windows every time, for every seed."""
    log_every: int = 10
    """Write a metrics record and refresh the display every N steps."""
    sample_tokens: int = 200
    """Tokens to sample from the model at the end of training (0 = none)."""
    seed: int = 1337
    """Seed for initialisation, batches and dropout."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu, cuda, cuda:1, ..."""
    precision: Literal["auto", "fp32", "bf16", "bf16-matmul", "fp16"] = "auto"
    """auto: the fastest of fp32, bf16 and bf16-matmul (attention in fp32) for this model
    here (a short probe, cached); bf16/fp16: autocast (fp16 adds a GradScaler)."""
    precision_probe_seconds: float = 60.0
    """--precision auto: the most seconds its probe may spend timing steps; past it the run
    takes fp32 (and the header says so)."""
    subnormals: Literal["flush", "keep"] = "flush"
    """CPU float math: flush values below 1.2e-38 to zero, which x86 cores otherwise compute on
    a slow path (an fp32 step can take twice as long); keep: IEEE behaviour."""
    out_dir: str = "runs/default"
    """Run directory: metrics, snapshots, plots."""
    resume: str | None = None
    """Continue the run in this directory (replaces --out-dir); fails if it has no snapshot."""
    auto_resume: bool = True
    """Continue automatically when --out-dir holds a snapshot; False refuses such a directory."""
    progress: bool = True
    """Show a live progress display on the terminal."""
    tokenizer: str = "auto"
    """auto | bytes | bpe | ids | PATH/tokenizer.json. auto: the run's own on resume, else
    --init-from's or a prepared folder's, else bytes; bpe: learned here from the training
    text; ids: token files of an unknown tokenizer."""
    tokenizer_sha256: str = ""
    """sha256 of the run's tokenizer.json, recorded by the trainer ('' for bytes and ids); set it
    to refuse any other tokenizer."""
    init_from: str | None = None
    """Start a new run from these weights: RUN_DIR, FILE.safetensors or hf:FOLDER (GPT-2
    layout). Weights only: fresh optimizer, schedule and guard, step 0."""


def _tiny() -> TrainConfig:
    """The CPU default: 0.8M parameters, 1000 steps of 16 x 128 tokens, ~70 s on two cores."""
    return TrainConfig()


def _small() -> TrainConfig:
    """A bigger model for a GPU or a patient CPU."""
    return TrainConfig(
        model=ModelConfig(n_layer=6, n_head=6, d_model=384, block_size=256, dropout=0.1),
        optim=OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=100),
        steps=2000,
        eval_every=250,
    )


def _speedrun() -> TrainConfig:
    """The tiny shape with the NanoGPT speedrun's changes that pay at this scale
    (docs/benchmarks.md): Muon on the hidden matrices, rotary positions, QK-norm, ReLU squared,
    the head tied to the embedding; 250 steps beat the tiny preset's 1000-step validation
    loss (200 do not). The speedrun's untied head and zero-init projections each cost loss
    here (measured over two seeds by benchmarks/ablate_recipe.py), so both stay off."""
    return TrainConfig(
        model=ModelConfig(positions="rotary", qk_norm=True, activation="relu2"),
        optim=OptimConfig(name="muon"),
        steps=250,
    )


def _smoke() -> TrainConfig:
    """Seconds-long run for tests and a quick look."""
    return TrainConfig(
        model=ModelConfig(n_layer=2, n_head=2, d_model=32, block_size=32),
        data=DataConfig(max_bytes=200_000, batch_size=4),
        optim=OptimConfig(lr=2e-3, warmup_steps=2),
        steps=8,
        eval_every=4,
        eval_batches=2,
        log_every=2,
        sample_tokens=16,
        precision="fp32",  # fixed, so quick runs compare across machines
        snapshot=SnapshotConfig(every=0),  # at the end (and every 5 minutes), not every eval
    )


PRESETS: dict[str, Callable[[], TrainConfig]] = {
    "tiny": _tiny,
    "small": _small,
    "smoke": _smoke,
    "speedrun": _speedrun,
}


def apply_toml(cfg: TrainConfig, path: str | Path) -> TrainConfig:
    """Overlay a TOML file (sections named like the flags: [model], [optim], ...) on `cfg`."""
    p, source = Path(path), f"--config {path}"
    if not p.is_file():
        raise ConfigError(f"{source}: no such file; try the path of a TOML file")
    try:
        data = tomllib.loads(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{source}: not UTF-8 text (byte {e.start}); try saving it as UTF-8"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: not valid TOML ({e}); try fixing that line") from None
    except (RecursionError, ValueError) as e:  # nesting past the parser's depth; 4,300+ digits
        why = "nested too deeply" if isinstance(e, RecursionError) else "a number too long"
        raise ConfigError(f"{source}: cannot read it ({why}); try a plain settings file") from None
    except OSError as e:
        raise ConfigError(f"{source}: cannot read it ({e.strerror}); try another file") from None
    return typing.cast(TrainConfig, overlay(cfg, data, "", source))
