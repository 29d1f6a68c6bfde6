"""host_sync: the ops in the user's step that make the host wait for the accelerator.

The probe's op watch counted them per `file:line` during one step. A sync in the step's own
code is a warning (slow on every step, and avoidable); one inside an installed library (not
the user's to change), on a line marked `# sync:` (the convention for an intentional one),
or inside a module's forward (the model's algorithm: routing, capacities) is info.
"""

from __future__ import annotations

from isotrain.doctor.ground.context import Context
from isotrain.doctor.ground.finding import Finding, Severity
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ground.probe import probe_ok

__all__ = ["HOST_SYNC", "check_host_sync"]

_READ_FIX = (
    "keep the value on the device: `total += loss.detach()`, read it every N steps on a line "
    "marked `# sync:`; decide with torch.where instead of `if t:` (isotrain.guard.StepGuard "
    "skips non-finite steps with no sync)"
)
_SIZE_FIX = (
    "use fixed-size ops: torch.where(mask, x, 0) and a masked mean ((x * mask).sum() / "
    "mask.sum()) instead of x[mask] / nonzero / masked_select; cross_entropy(ignore_index=...) "
    "skips targets without selecting them"
)
_COMPARE_FIX = "compare on the device: keep (a == b).all() as a tensor and read it at log steps"
_HOST_FIX = "move values to the host only at log steps, on a line marked `# sync:`"


def _fix_for(what: str) -> str:
    """The fix for the construct the op came from (the `what` of the op watch)."""
    if what.startswith((".item()", "bool(t)")):
        return _READ_FIX
    if what.startswith(("torch.equal", "torch.allclose")):
        return _COMPARE_FIX
    if what.startswith((".tolist()", ".numpy()", ".cpu()", '.to("cpu")')):
        return _HOST_FIX
    return _SIZE_FIX


_NONE = "none needed; on an accelerator it waits"
_VALIDATING = " (torch.distributions checking its arguments' values on the host)"
_VALIDATE_FIX = (
    "pass validate_args=False to the distribution (or call torch.distributions.Distribution."
    "set_default_validate_args(False) once) when its inputs are known to be valid"
)
_IN_FORWARD = (
    " inside the model's forward: part of its algorithm (a data-dependent shape, as an MoE's "
    "routing and capacity need); on an accelerator the step waits there"
)


def check_host_sync(ctx: Context) -> list[Finding]:
    """One finding per `file:line` of the step that forces a host-device sync: a warning in
    the step's own code (avoidable bookkeeping, slow on every step), info inside a library,
    on a line marked `# sync:`, or inside a module's forward (the model's own algorithm)."""
    watch = probe_ok(ctx).watch
    out = []
    for (where, what), n in sorted(watch.syncs.items(), key=lambda kv: -kv[1]):
        sev: Severity = "info"
        note, fix = "", _fix_for(what)
        if where in watch.library_syncs:
            note, fix = " (inside an installed library, not your code)", _NONE
        elif where in watch.marked_syncs:
            note, fix = " (the line is marked `# sync:`: intentional)", _NONE
        elif where in watch.validating_syncs:
            sev = "warning"
            note, fix = _VALIDATING, _VALIDATE_FIX
        elif where in watch.forward_syncs:
            note, fix = _IN_FORWARD, "keep it where the value sizes work; otherwise " + fix
        else:
            sev = "warning"
        out.append(Finding("host_sync", sev, where, f"{n} sync(s) per step from {what}{note}", fix))
    return out


HOST_SYNC = Check(
    "host_sync",
    (
        Kind(
            "host_sync",
            "an op in the step forces a host-device sync (.item(), nonzero, mask indexing)",
        ),
    ),
    check_host_sync,
)
