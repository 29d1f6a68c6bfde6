"""State contexts that always undo themselves, and an audit that proves nothing leaked.

Mode, precision, gradient, RNG and subnormal-flushing changes are captured on entry and
restored in ``finally``, per submodule. This ``__init__`` is the package's whole public API;
the ``_``-modules behind it are private.
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
from isotrain.contexts._subnormals import flush_subnormals, subnormals_flushed

__all__ = [
    "AutocastInfo",
    "StateAudit",
    "StateLeakError",
    "assert_isolated",
    "autocast_if_available",
    "capture_rng_state",
    "eval_mode",
    "flush_subnormals",
    "frozen",
    "resolve_autocast",
    "restore_rng_state",
    "rng_isolated",
    "subnormals_flushed",
    "train_mode",
]
