"""The switches checkpointed forwards read while memory is measured, and the byte tally."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["_Recorder", "_State", "note_cached_outputs"]


# NOTE [measurement state]: checkpointed forwards read these two switches as plain class
# attributes, which dynamo reads and guards on simply. They are set only inside measurement
# calls and restored in `finally`; measuring is therefore not thread-safe: one thread at a time.
class _State:
    """Process-wide switches read by checkpointed forwards (plain attributes: dynamo-friendly)."""

    bypass: bool = False  # run wrapped modules without checkpoint (baseline FLOPs)
    recorder: _Recorder | None = None  # active byte tally, or None


class _Recorder:
    """Tallies unique saved storages, attributing each to the innermost running block."""

    def __init__(self, exclude_ptrs: set[int]) -> None:
        self.exclude = exclude_ptrs
        self.seen: set[int] = set()
        self.bytes: dict[str, int] = {}
        self.stack: list[str] = []

    def add(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.is_meta or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self.exclude or ptr in self.seen:
            return
        self.seen.add(ptr)
        where = self.stack[-1] if self.stack else ""
        self.bytes[where] = self.bytes.get(where, 0) + storage.nbytes()


def note_cached_outputs(out: Any) -> None:
    """Count tensors a selective-checkpoint cache keeps (they bypass saved-tensor hooks)."""
    rec = _State.recorder
    if rec is not None:
        for t in out if isinstance(out, (tuple, list)) else (out,):
            rec.add(t)
