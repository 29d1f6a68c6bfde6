"""labels_truncated: class ids made by `.long()` from labels a transform turned into fractions.

A label mask read as an image and passed through ToTensor (or Normalize, or a resize that
interpolates) holds k/255, not class k; `.long()` then truncates every id to 0 and the class
loss trains on one class. Read from the loss calls of the user's step (`LossCall`): their
integer targets against the floating tensors of the batch they came from.
"""

from __future__ import annotations

import torch

from isotrain.doctor.data.draw import leaves
from isotrain.doctor.ground.calls import LossCall
from isotrain.doctor.ground.context import Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ground.trace import trace_ok

__all__ = ["LABELS", "check_labels_truncated"]

_MAX_VALUES = 256  # a label tensor holds at most this many distinct values (an image more)


def _on_grid(values: torch.Tensor) -> bool:
    """Whether every value is a multiple of 1/255 (an 8-bit image ToTensor scaled)."""
    scaled = values.double() * 255
    return bool(((scaled - scaled.round()).abs() < 1e-3).all())


def _shown(values: torch.Tensor) -> str:
    """The first distinct values, with their multiple of 1/255 when they sit on that grid."""
    v = values[:5].double()
    scaled, on_grid = v * 255, _on_grid(values)
    text = ", ".join(f"{x:.4g}" for x in v.tolist())
    more = " ..." if len(values) > 5 else ""
    ks = ", ".join(str(int(x)) for x in scaled.round().tolist())
    return f"{text}{more}" + (f" (= {ks} / 255)" if on_grid else "")


def _truncated(ctx: Context, call: LossCall) -> Finding | None:
    """The finding for one class loss call whose targets are a batch field truncated."""
    target = call.target
    if target is None or target.numel() == 0:
        return None
    batch = ctx.batches[call.step % len(ctx.batches)]
    try:
        main = ctx.main_input(batch)[0]
    except ValueError:
        main = None
    flat = target.reshape(-1).cpu()
    for path, field in leaves(batch):
        if field is main or not field.is_floating_point() or field.numel() != flat.numel():
            continue
        f = field.detach().reshape(-1).cpu().double()
        values = f.unique()
        if len(values) > _MAX_VALUES or bool((values == values.trunc()).all()):
            continue  # an image, or labels already whole numbers
        if not torch.equal(f.trunc().long(), flat.long()):
            continue  # the targets are not this field cut to integers
        if len(flat.unique()) < 2 and not _on_grid(values):
            continue  # one class cut from arbitrary fractions (a weight?): too little to say
        name = "batch" + "".join(f"[{k!r}]" for k in path)
        lost = int((f != f.trunc()).sum())
        return Finding(
            "labels_truncated", "error", call.where,
            f"{call.name}'s class targets are {name} cut to integers, but {name} holds "
            f"fractions: values {_shown(values)}; {lost} of {f.numel()} labels lost their "
            f"class, and the targets hold only {flat.unique().tolist()[:5]}",
            "keep class ids as integers from file to loss: do not pass a label mask through "
            "ToTensor / Normalize (it divides by 255), use torch.as_tensor(np.array(mask), "
            "dtype=torch.long) or torchvision.transforms.v2.PILToTensor, and resize masks "
            "with nearest interpolation",
        )  # fmt: skip
    return None


def check_labels_truncated(ctx: Context) -> list[Finding]:
    """Class targets that equal a fractional field of their batch truncated to integers."""
    found: dict[str, Finding] = {}
    for call in trace_ok(ctx).watch.calls:
        f = None if call.where in found else _truncated(ctx, call)
        if f is not None:
            found[call.where] = f
    return list(found.values())


LABELS = Check(
    "labels_truncated",
    (
        Kind(
            "labels_truncated",
            "class ids cut to integers from fractional labels (a mask scaled by ToTensor)",
        ),
    ),
    check_labels_truncated,
)
