"""autocast_not_applied: inside the user's autocast region, matmul-class ops in float32.

The call watch's dispatch mode saw them during the first traced call (NOTE [escapes] in
ground.calls): an in-place or out= form autocast leaves alone, a region opened for another device
than the tensors', a custom kernel autocast has no rule for (information); torch's own
"Disabling autocast" warning says a region never opened at all.
"""

from __future__ import annotations

from isotrain.doctor.ground.context import Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ground.trace import trace_ok

__all__ = ["AUTOCAST_NOT_APPLIED", "check_autocast"]

_DISABLED = "Disabling autocast"


def _fix(what: str) -> str:
    if "in-place" in what:
        return "use the out-of-place op (torch.addmm(...), no out=) so autocast casts it"
    return "open the region for the tensors' device: torch.autocast(device_type=x.device.type)"


def check_autocast(ctx: Context) -> list[Finding]:
    """One finding per line whose matmul-class op escaped the autocast region it ran in."""
    watch = trace_ok(ctx).watch
    out = []
    for (where, what), n in sorted(watch.fp32_ops.items()):
        out.append(Finding(
            "autocast_not_applied", "warning", where,
            f"{n} call(s) per step: {what}: the step runs it in full precision, slower than "
            "the region promises",
            _fix(what),
        ))  # fmt: skip
    for (where, what), n in sorted(watch.opaque_ops.items()):
        op = what.split(" ")[2]
        out.append(Finding(
            "autocast_not_applied", "info", where,
            f"{n} call(s) per step: {what}; if it multiplies matrices, it does so in float32",
            f"register an autocast rule for it: torch.library.register_autocast({op!r}, "
            "device_type, torch.bfloat16)",
        ))  # fmt: skip
    for where, message in {w: m for w, m in watch.warned if _DISABLED in m}.items():
        said = message.splitlines()[0].rstrip(".")
        out.append(Finding(
            "autocast_not_applied", "warning", where,
            f"torch disabled your autocast region: {said}; every op in it runs in float32",
            "open the region for the device the model runs on: torch.autocast("
            "device_type=next(model.parameters()).device.type, dtype=torch.bfloat16)",
        ))  # fmt: skip
    return out


AUTOCAST_NOT_APPLIED = Check(
    "autocast_not_applied",
    (Kind("autocast_not_applied", "inside an autocast region, matmul-class ops run in float32"),),
    check_autocast,
)
