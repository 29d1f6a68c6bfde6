"""torch.compile without recompile storms: per-block compile, length buckets, warm-up, no storms.

``compile_model`` compiles each block in place (``compiled_blocks`` names them); ``warmup``
compiles one graph per bucket up front; ``no_recompiles`` then turns any new graph, or a block
run eagerly, into an error.
This ``__init__`` is the package's whole public API; the ``_``-modules behind it are private.
"""

from isotrain.compile._buckets import BucketBatchSampler, bucket_for, default_buckets, pad_to_bucket
from isotrain.compile._regional import (
    CompileAvailability,
    compile_available,
    compile_model,
    compiled_blocks,
)
from isotrain.compile._stats import CompileStats, compile_counters, no_recompiles, track_compiles
from isotrain.compile._warmup import warmup

__all__ = [
    "BucketBatchSampler",
    "CompileAvailability",
    "CompileStats",
    "bucket_for",
    "compile_available",
    "compile_counters",
    "compile_model",
    "compiled_blocks",
    "default_buckets",
    "no_recompiles",
    "pad_to_bucket",
    "track_compiles",
    "warmup",
]
