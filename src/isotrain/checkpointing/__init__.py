"""Activation checkpointing by policy, with the trade-off measured in bytes and FLOPs.

``apply_activation_checkpointing`` wraps chosen blocks in place (keys unchanged, reversible),
``checkpointed_blocks`` names them; ``measure_activation_memory`` counts saved bytes per block
and the FLOPs recomputation adds.
This ``__init__`` is the package's whole public API; the ``_``-modules behind it are private.
"""

from isotrain.checkpointing._measure import BlockStats, MemoryReport, measure_activation_memory
from isotrain.checkpointing._policy import (
    ACPolicy,
    CheckpointedTransformerBlock,
    apply_activation_checkpointing,
    checkpointed_blocks,
    parse_policy,
    remove_activation_checkpointing,
)
from isotrain.checkpointing._selective import selective_policy

__all__ = [
    "ACPolicy",
    "BlockStats",
    "CheckpointedTransformerBlock",
    "MemoryReport",
    "apply_activation_checkpointing",
    "checkpointed_blocks",
    "measure_activation_memory",
    "parse_policy",
    "remove_activation_checkpointing",
    "selective_policy",
]
