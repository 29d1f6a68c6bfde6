"""Non-finite and spike guard: a NaN/Inf or spiking step never reaches the weights.

``StepGuard`` decides on the device and skips by selection (never multiply-by-0);
``GuardedOptimizer`` is the same step behind the ``torch.optim.Optimizer`` interface;
``Rollback``, ``find_nonfinite_source`` and ``FaultInjector`` recover, explain and rehearse.
This ``__init__`` is the package's whole public API; the ``_``-modules behind it are private.
"""

from isotrain.guard._outcome import SkipReason, StepOutcome
from isotrain.guard._recovery import (
    FaultInjector,
    Provenance,
    Rollback,
    RollbackAction,
    find_nonfinite_source,
    load_failure_case,
    nonfinite_grads,
    save_failure_case,
)
from isotrain.guard._safe import safe_backward
from isotrain.guard._spikes import HostSpikeDetector, SpikeDetector
from isotrain.guard._step import StepGuard
from isotrain.guard._wrapped import GuardedOptimizer

__all__ = [
    "FaultInjector",
    "GuardedOptimizer",
    "HostSpikeDetector",
    "Provenance",
    "Rollback",
    "RollbackAction",
    "SkipReason",
    "SpikeDetector",
    "StepGuard",
    "StepOutcome",
    "find_nonfinite_source",
    "load_failure_case",
    "nonfinite_grads",
    "safe_backward",
    "save_failure_case",
]
