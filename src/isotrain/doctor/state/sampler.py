"""sampler_epoch: a sampler that draws the same order every epoch unless told the epoch.

A DistributedSampler (or any sampler with `set_epoch`) seeds its shuffle with its epoch: two
passes over it draw the same order until `set_epoch(epoch)` is called before each epoch. The
doctor sees the DataLoader, not the epoch loop, so it iterates the sampler twice (the
sampler's own state put back) and says what it saw, as information.
"""

from __future__ import annotations

from isotrain.doctor.ground.context import Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ground.sampling import draw, epoch_sampler

__all__ = ["SAMPLER_EPOCH", "check_sampler_epoch"]

DRAWN = 4096  # indices compared from each pass


def check_sampler_epoch(ctx: Context) -> list[Finding]:
    """sampler_epoch: a shuffling sampler with set_epoch draws the same order twice."""
    sampler = epoch_sampler(ctx.source)
    if sampler is None:
        return []
    epoch = getattr(sampler, "epoch", None)
    first, second = ([int(i) for i in draw(sampler, DRAWN)] for _ in range(2))
    if first != second or first == sorted(first):
        return []
    return [Finding(
        "sampler_epoch", "info", type(sampler).__name__,
        f"two passes over your DataLoader's {type(sampler).__name__} (epoch {epoch}) drew the "
        "same shuffled order: every epoch repeats it unless your epoch loop calls "
        "set_epoch(epoch) before iterating (the doctor sees your step, not that loop)",
        "for epoch in range(epochs): sampler.set_epoch(epoch); for batch in loader: ...",
    )]  # fmt: skip


SAMPLER_EPOCH = Check(
    "sampler_epoch",
    (Kind("sampler_epoch", "the DataLoader's sampler draws the same order each pass: set_epoch"),),
    check_sampler_epoch,
)
