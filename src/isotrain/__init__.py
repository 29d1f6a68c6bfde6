"""isotrain: five PyTorch training patterns as tested library pieces, plus a reference trainer.

Each pattern lives in its own module and imports only torch and the standard library:

- `isotrain.autograd`: straight-through estimators and compile-safe custom ops
  (`isotrain.autograd_linear`: bf16 linear layers at full speed on AVX2 CPUs)
- `isotrain.checkpointing`: activation checkpointing by policy, with measured memory
- `isotrain.guard`: a sync-free guard that keeps NaN/Inf and spikes out of the weights
- `isotrain.compile`: per-block torch.compile, length buckets, recompile accounting
- `isotrain.contexts`: mode, precision, gradient and RNG changes that undo themselves

`isotrain.train` is the reference GPT trainer built on them (`isotrain train`).
"""

from isotrain.autograd import (
    LSQQuantizer,
    StraightThroughEstimator,
    fake_quantize,
    gumbel_softmax_st,
    lsq_quantize,
    quantize,
    round_ste,
    sign_ste,
)
from isotrain.autograd_linear import (
    Bf16Linear,
    bf16_linear,
    bf16_linear_layers,
    native_bf16_matmul,
)
from isotrain.autograd_ops import QuantLinear, fused_fake_quantize, quantize_linear_layers
from isotrain.checkpointing import (
    ACPolicy,
    CheckpointedTransformerBlock,
    MemoryReport,
    apply_activation_checkpointing,
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
    eval_mode,
    frozen,
    rng_isolated,
    train_mode,
)
from isotrain.guard import SkipReason, StepGuard, StepOutcome, safe_backward
from isotrain.guard_recovery import (
    FaultInjector,
    Provenance,
    Rollback,
    RollbackAction,
    find_nonfinite_source,
    load_failure_case,
    nonfinite_grads,
    save_failure_case,
)
from isotrain.guard_spikes import SpikeDetector

__version__ = "0.1.0"

__all__ = [
    "ACPolicy",
    "AutocastInfo",
    "Bf16Linear",
    "BucketBatchSampler",
    "CheckpointedTransformerBlock",
    "CompileStats",
    "FaultInjector",
    "LSQQuantizer",
    "MemoryReport",
    "Provenance",
    "QuantLinear",
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
    "compile_available",
    "compile_counters",
    "compile_model",
    "default_buckets",
    "eval_mode",
    "fake_quantize",
    "find_nonfinite_source",
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
    "quantize_linear_layers",
    "remove_activation_checkpointing",
    "rng_isolated",
    "round_ste",
    "safe_backward",
    "save_failure_case",
    "selective_policy",
    "sign_ste",
    "track_compiles",
    "train_mode",
    "warmup",
]
