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

from isotrain._shared import BlockSpec, find_blocks
from isotrain.autograd import (
    Bf16Linear,
    LSQQuantizer,
    QuantLinear,
    StraightThroughEstimator,
    bf16_linear,
    bf16_linear_layers,
    fake_quantize,
    fused_fake_quantize,
    gumbel_softmax_st,
    lsq_quantize,
    native_bf16_matmul,
    quantize,
    quantize_linear_layers,
    round_ste,
    sign_ste,
)
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
    capture_rng_state,
    eval_mode,
    frozen,
    restore_rng_state,
    rng_isolated,
    train_mode,
)
from isotrain.guard import (
    FaultInjector,
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

__version__ = "0.1.0"

__all__ = [
    "ACPolicy",
    "AutocastInfo",
    "Bf16Linear",
    "BlockSpec",
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
    "capture_rng_state",
    "compile_available",
    "compile_counters",
    "compile_model",
    "default_buckets",
    "eval_mode",
    "fake_quantize",
    "find_blocks",
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
    "restore_rng_state",
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
