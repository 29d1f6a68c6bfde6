"""isotrain: five PyTorch training patterns as tested library pieces, plus a reference trainer.

Each pattern is its own package, importing only torch, the standard library and the few
helpers in `isotrain._shared`; its `__init__` is its whole public API:

- `isotrain.autograd`: straight-through estimators, compile-safe custom ops, QAT and bf16 layers
- `isotrain.checkpointing`: activation checkpointing by policy, with measured memory
- `isotrain.guard`: a sync-free guard that keeps NaN/Inf and spikes out of the weights
- `isotrain.compile`: per-block torch.compile, length buckets, recompile accounting
- `isotrain.contexts`: mode, precision, gradient and RNG changes that undo themselves

`isotrain.train` is the reference GPT trainer built on them (`isotrain train`).
"""

# NOTE [lazy public API]
# `import isotrain` imports no torch: every public name is looked up in the package that
# defines it on first use (PEP 562 module __getattr__), then kept here. So the `isotrain`
# command, whose module lives in this package, answers --help, --version and argument errors
# without the seconds that importing torch takes, and `from isotrain import X` works as before.

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {  # each public name's home package (names separated by spaces)
    "isotrain._shared": "BlockSpec find_blocks",
    "isotrain.autograd": (
        "Bf16Linear LSQQuantizer QuantConv1d QuantConv2d QuantConv3d QuantLinear QuantReport "
        "StraightThroughEstimator bf16_linear bf16_linear_layers fake_quantize "
        "fused_fake_quantize gumbel_softmax_st lsq_quantize native_bf16_matmul quantize "
        "quantize_layers quantize_linear_layers round_ste sign_ste"
    ),
    "isotrain.checkpointing": (
        "ACPolicy CheckpointedTransformerBlock MemoryReport apply_activation_checkpointing "
        "checkpointed_blocks measure_activation_memory parse_policy "
        "remove_activation_checkpointing selective_policy"
    ),
    "isotrain.compile": (
        "BucketBatchSampler CompileStats bucket_for compile_available compile_counters "
        "compile_model compiled_blocks default_buckets no_recompiles pad_to_bucket "
        "track_compiles warmup"
    ),
    "isotrain.contexts": (
        "AutocastInfo StateAudit StateLeakError assert_isolated autocast_if_available "
        "capture_rng_state eval_mode flush_subnormals frozen restore_rng_state rng_isolated "
        "subnormals_flushed train_mode"
    ),
    "isotrain.guard": (
        "FaultInjector GuardedOptimizer Provenance Rollback RollbackAction SkipReason "
        "SpikeDetector StepGuard StepOutcome find_nonfinite_source load_failure_case "
        "nonfinite_grads safe_backward save_failure_case"
    ),
}

_HOME = {name: module for module, names in _EXPORTS.items() for name in names.split()}
_PACKAGES = ("_shared", "autograd", "checkpointing", "compile", "contexts", "guard")

if TYPE_CHECKING:  # the same names, for type checkers (tests/test_public_api.py compares them)
    from isotrain._shared import BlockSpec, find_blocks
    from isotrain.autograd import (
        Bf16Linear,
        LSQQuantizer,
        QuantConv1d,
        QuantConv2d,
        QuantConv3d,
        QuantLinear,
        QuantReport,
        StraightThroughEstimator,
        bf16_linear,
        bf16_linear_layers,
        fake_quantize,
        fused_fake_quantize,
        gumbel_softmax_st,
        lsq_quantize,
        native_bf16_matmul,
        quantize,
        quantize_layers,
        quantize_linear_layers,
        round_ste,
        sign_ste,
    )
    from isotrain.checkpointing import (
        ACPolicy,
        CheckpointedTransformerBlock,
        MemoryReport,
        apply_activation_checkpointing,
        checkpointed_blocks,
        measure_activation_memory,
        parse_policy,
        remove_activation_checkpointing,
        selective_policy,
    )
    from isotrain.compile import (
        BucketBatchSampler,
        CompileStats,
        bucket_for,
        compile_available,
        compile_counters,
        compile_model,
        compiled_blocks,
        default_buckets,
        no_recompiles,
        pad_to_bucket,
        track_compiles,
        warmup,
    )
    from isotrain.contexts import (
        AutocastInfo,
        StateAudit,
        StateLeakError,
        assert_isolated,
        autocast_if_available,
        capture_rng_state,
        eval_mode,
        flush_subnormals,
        frozen,
        restore_rng_state,
        rng_isolated,
        subnormals_flushed,
        train_mode,
    )
    from isotrain.guard import (
        FaultInjector,
        GuardedOptimizer,
        Provenance,
        Rollback,
        RollbackAction,
        SkipReason,
        SpikeDetector,
        StepGuard,
        StepOutcome,
        find_nonfinite_source,
        load_failure_case,
        nonfinite_grads,
        safe_backward,
        save_failure_case,
    )


def __getattr__(name: str) -> Any:
    """A public name (or pattern package) on first use: imported from its home, then cached."""
    if name in _PACKAGES:
        value: Any = importlib.import_module(f"isotrain.{name}")
    elif name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
    else:
        raise AttributeError(f"module 'isotrain' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "ACPolicy",
    "AutocastInfo",
    "Bf16Linear",
    "BlockSpec",
    "BucketBatchSampler",
    "CheckpointedTransformerBlock",
    "CompileStats",
    "FaultInjector",
    "GuardedOptimizer",
    "LSQQuantizer",
    "MemoryReport",
    "Provenance",
    "QuantConv1d",
    "QuantConv2d",
    "QuantConv3d",
    "QuantLinear",
    "QuantReport",
    "Rollback",
    "RollbackAction",
    "SkipReason",
    "SpikeDetector",
    "StateAudit",
    "StateLeakError",
    "StepGuard",
    "StepOutcome",
    "StraightThroughEstimator",
    "__version__",
    "apply_activation_checkpointing",
    "assert_isolated",
    "autocast_if_available",
    "bf16_linear",
    "bf16_linear_layers",
    "bucket_for",
    "capture_rng_state",
    "checkpointed_blocks",
    "compile_available",
    "compile_counters",
    "compile_model",
    "compiled_blocks",
    "default_buckets",
    "eval_mode",
    "fake_quantize",
    "find_blocks",
    "find_nonfinite_source",
    "flush_subnormals",
    "frozen",
    "fused_fake_quantize",
    "gumbel_softmax_st",
    "load_failure_case",
    "lsq_quantize",
    "measure_activation_memory",
    "native_bf16_matmul",
    "no_recompiles",
    "nonfinite_grads",
    "pad_to_bucket",
    "parse_policy",
    "quantize",
    "quantize_layers",
    "quantize_linear_layers",
    "remove_activation_checkpointing",
    "restore_rng_state",
    "rng_isolated",
    "round_ste",
    "safe_backward",
    "save_failure_case",
    "selective_policy",
    "sign_ste",
    "subnormals_flushed",
    "track_compiles",
    "train_mode",
    "warmup",
]
