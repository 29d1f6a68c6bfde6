"""host_sync: the ops in the user's step that make the host wait for the accelerator.

The probe's op watch counted them per `file:line` during one step. A sync in the step's own
code is a warning (slow on every step, and avoidable); one inside an installed library (not
the user's to change), on a line marked `# sync:` (the convention for an intentional one),
or inside a module's forward (the model's algorithm: routing, capacities) is info. Under
epoch= a site is judged by how its syncs grow with the batches (NOTE [syncs per batch]).
"""

from __future__ import annotations

from isotrain.doctor.ground.context import CannotRun, Context
from isotrain.doctor.ground.finding import Finding, Severity
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ground.probe import probe_ok
from isotrain.doctor.ground.watch import OpWatch, watching

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
    if ctx.per_epoch:
        return _per_batch(ctx, watch)
    return [
        _judged(watch, where, what, f"{n} sync(s) per step from {what}")
        for (where, what), n in sorted(watch.syncs.items(), key=lambda kv: -kv[1])
    ]


def _judged(watch: OpWatch, where: str, what: str, seen: str, *, often: bool = True) -> Finding:
    """The finding of one site: its severity and fix by where it is, `seen` its evidence;
    a site that does not sync on every step or batch (`often` False) is info."""
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
    if not often:
        sev, fix = "info", "none needed while it stays off the per-batch path"
    return Finding("host_sync", sev, where, f"{seen}{note}", fix)


# NOTE [syncs per batch]
# Under epoch= the doctor's steps run the user's epoch function over one batch, so batch_idx is
# always 0 and a log line under `if batch_idx % log_interval == 0` (pytorch/examples mnist)
# would sync on every call. The epoch function runs once more over all the examined batches
# (k of them): a site that syncs k times as often as over one batch syncs on every batch (a
# warning, as a step's would be); one that does not syncs once a call or every few batches.
def _per_batch(ctx: Context, one: OpWatch) -> list[Finding]:
    """host_sync under epoch=: each site judged by how its syncs grow with the batches."""
    k = len(ctx.batches)
    model, opt = ctx.fresh()
    try:
        with watching() as many:
            ctx.run_epoch(model, opt, ctx.batches)
    except Exception as e:
        first = (str(e).splitlines() or [""])[0][:120]
        raise CannotRun(
            f"your epoch function raised {type(e).__name__} ({first}) over {k} batches"
        ) from e
    finally:
        ctx.reset()
    out = []
    for (where, what), n in sorted(many.syncs.items(), key=lambda kv: -kv[1]):
        n1 = one.syncs.get((where, what), 0)
        if n >= k * max(n1, 1):
            seen = f"{n / k:g} sync(s) per batch from {what} ({n} in one call of your epoch "
            seen += f"function over {k} batches)"
            out.append(_judged(many, where, what, seen))
        else:
            seen = f"{n} sync(s) from {what} in one call of your epoch function over {k} batches"
            seen += f" and {n1} over 1 batch: not on every batch (once a call, or every few "
            seen += "batches: a log interval)"
            out.append(_judged(many, where, what, seen, often=False))
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
