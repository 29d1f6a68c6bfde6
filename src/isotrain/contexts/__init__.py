"""State contexts that always undo themselves, and an audit that proves nothing leaked.

Mode, precision, gradient and RNG changes are captured on entry and restored in ``finally``,
per submodule. This ``__init__`` is the package's whole public API; the ``_``-modules behind
it are private.
"""

from isotrain.contexts._audit import StateAudit, StateLeakError, assert_isolated
from isotrain.contexts._scoped import (
    AutocastInfo,
    autocast_if_available,
    capture_rng_state,
    eval_mode,
    frozen,
    resolve_autocast,
    restore_rng_state,
    rng_isolated,
    train_mode,
)

__all__ = [
    "AutocastInfo",
    "StateAudit",
    "StateLeakError",
    "assert_isolated",
    "autocast_if_available",
    "capture_rng_state",
    "eval_mode",
    "frozen",
    "resolve_autocast",
    "restore_rng_state",
    "rng_isolated",
    "train_mode",
]
