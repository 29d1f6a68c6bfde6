"""host_sync: the ops in the user's step that make the host wait for the accelerator.

The probe's op watch counted them per `file:line` during one step. A sync in the user's
own code is a warning; one inside an installed library (not the user's to change), or on a
line marked `# sync:` (the convention for an intentional one), is info.
"""

from __future__ import annotations

from isotrain.doctor._context import Context
from isotrain.doctor._finding import Finding, Severity
from isotrain.doctor._probe import probe_ok

__all__ = ["check_host_sync"]

_FIX = (
    "keep values on the device: accumulate `total += loss.detach()` and read it every N "
    "steps (mark that line `# sync:`); decide with torch.where instead of `if t:`; use fixed-"
    "size ops (torch.where(mask, x, 0)) instead of x[mask] / nonzero; isotrain.guard.StepGuard "
    "skips non-finite steps with no sync"
)


def check_host_sync(ctx: Context) -> list[Finding]:
    """One finding per `file:line` of the step that forces a host-device sync."""
    watch = probe_ok(ctx).watch
    out = []
    for (where, what), n in sorted(watch.syncs.items(), key=lambda kv: -kv[1]):
        library, marked = where in watch.library_syncs, where in watch.marked_syncs
        evidence = f"{n} sync(s) per step from {what}"
        if library:
            evidence += " (inside an installed library, not your code)"
        elif marked:
            evidence += " (the line is marked `# sync:`: intentional)"
        sev: Severity = "info" if library or marked else "warning"
        fix = _FIX if sev == "warning" else "none needed here; on an accelerator it waits once"
        out.append(Finding("host_sync", sev, where, evidence, fix))
    return out
