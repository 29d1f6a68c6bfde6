"""The doctor's line between ranks: a gloo group of its own, small summaries, a timeout on each.

Every exchange is tagged with what it is about, runs on a gloo group the doctor makes (never the
user's group, so it cannot pair with the user's collectives) and is bounded by that group's
timeout. A rank that does not come is named (NOTE [naming the silent rank]); ranks that come to
different exchanges are named with where each one was. Either way the link is broken from then
on and the caller stops comparing: nothing of the doctor's waits on a rank a second time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from isotrain._torch_private import default_store
from isotrain.doctor.ground.watch import doctors_own

__all__ = ["RankError", "Ranks", "checksum", "distributed", "float_sum", "split_ranks"]

# The originals, taken at import: the doctor's own calls never go through its collective check.
_ALL_REDUCE = dist.all_reduce
_ALL_GATHER_OBJECT = dist.all_gather_object
GRACE = 2.0  # seconds a failed exchange waits for the others to say they were there

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class RankError(RuntimeError):
    """The ranks cannot be compared any more: one did not answer, or they are at different
    points (`apart`); the message is one line naming the ranks."""

    def __init__(self, message: str, *, apart: bool = False) -> None:
        super().__init__(message)
        self.apart = apart


def distributed() -> bool:
    """True inside a process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def checksum(t: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 of `t`'s bits (their sum as integers, modulo 2**64), on `t`'s device: equal
    bits give equal sums, whatever the order of the reduction."""
    t = t.detach()
    local = getattr(t, "to_local", None)  # a DTensor: this rank's part
    if callable(local):
        t = local()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        t = t.to(torch.int8)
    flat = t.reshape(-1)  # a copy only where `t` is not contiguous
    size = flat.element_size()
    if (flat.numel() * size) % 8 == 0 and (flat.storage_offset() * size) % 8 == 0:
        return flat.view(torch.int64).sum()  # 8 bytes at a time: the fast reduction
    return flat.view(_BITS[size]).sum(dtype=torch.int64)


def float_sum(t: torch.Tensor) -> torch.Tensor:
    """`t`'s sum in at least float32: NaN or Inf when `t` holds one (or sums past 3e38)."""
    local = getattr(t, "to_local", None)
    t = (local() if callable(local) else t).detach()
    return t.sum(dtype=torch.float32) if t.element_size() < 4 else t.sum()


def split_ranks(values: Sequence[Any]) -> str:
    """'rank 1 differs from rank 0' for per-rank values: the most common value is the reference."""
    groups: dict[Any, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(v, []).append(r)
    ordered = sorted(groups.values(), key=lambda rs: (-len(rs), rs[0]))
    if all(len(rs) == 1 for rs in ordered):
        shown = ", ".join(str(rs[0]) for rs in ordered[:-1]) + f" and {ordered[-1][0]}"
        return f"ranks {shown} {'all ' if len(ordered) > 2 else ''}differ"
    ref, others = ordered[0], [r for rs in ordered[1:] for r in rs]

    def name(rs: list[int]) -> str:
        return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {', '.join(map(str, rs))}"

    verb = "differs" if len(others) == 1 else "differ"
    return f"{name(sorted(others))} {verb} from {name(ref)}"


# NOTE [naming the silent rank]
# A gloo collective that times out says only that a recv timed out. When an exchange fails,
# each rank that got there writes "<link>/<exchange>/<rank>" into the default group's store
# (torchrun's rendezvous store) and waits GRACE seconds for the others' keys: a rank whose key
# never comes was somewhere else (inside one of the user's collectives, a long rank-0-only
# task) or is gone, and the message names it. The store is touched only on this path.
class Ranks:
    """The doctor's gloo group over every rank of the default group, with a `timeout` (seconds)
    on every exchange; make it on every rank at the same point (it is itself an exchange)."""

    _made = 0  # links made by this process, in the same order on every rank

    def __init__(self, *, timeout: float, label: str = "doctor") -> None:
        if not timeout > 0:
            raise ValueError(f"the timeout between ranks must be > 0 seconds, got {timeout!r}")
        Ranks._made += 1
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout, self.uid, self.seq = timeout, f"isotrain-{label}-{Ranks._made}", 0
        self.broken: str | None = None
        self.group: Any = None
        try:
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        except Exception as e:
            raise self._failed("joining the doctor's group", e) from None

    def gather(self, what: str, payload: Any = None, *, note: str | None = None) -> list[Any]:
        """Every rank's `payload` for the exchange `what` (the same `what` on every rank);
        `note` says more about where this rank is, should the ranks be apart."""
        self._check()
        self.seq += 1
        got: list[Any] = [None] * self.world
        try:
            with doctors_own():  # its pickling reads sizes on the host: not the user's syncs
                _ALL_GATHER_OBJECT(got, (what, note or what, payload), group=self.group)
        except Exception as e:
            raise self._failed(note or what, e) from None
        if any(w != what for w, _, _ in got):
            where = "; ".join(f"rank {r} at {n}" for r, (_, n, _) in enumerate(got))
            self.broken = f"the ranks are at different points: {where}"
            raise RankError(self.broken, apart=True)
        return [p for _, _, p in got]

    def max_min(self, vec: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Elementwise max and min over ranks of a CPU vector, in one all-reduce."""
        self._check()
        self.seq += 1
        both = torch.cat([vec, -vec])
        try:
            with doctors_own():
                _ALL_REDUCE(both, op=dist.ReduceOp.MAX, group=self.group)
        except Exception as e:
            raise self._failed(what, e) from None
        n = vec.numel()
        return both[:n], -both[n:]

    def spread(self, t: torch.Tensor, what: str) -> float:
        """max over elements of (largest - smallest value across ranks) of `t` (same shape on
        every rank): the one tensor the doctor exchanges, and only once ranks differ."""
        local = getattr(t, "to_local", None)
        flat = (local() if callable(local) else t).detach().reshape(-1).double().cpu()
        hi, lo = self.max_min(flat, what)
        return float((hi - lo).max()) if flat.numel() else 0.0

    def close(self) -> None:
        """Drop the doctor's group (local: gloo tears down its own connections)."""
        group, self.group = self.group, None
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)

    def _check(self) -> None:
        if self.broken is not None:
            raise RankError(self.broken, apart=True)
        if self.group is None:
            raise RankError("the doctor's link between ranks is closed")

    def _failed(self, what: str, error: Exception) -> RankError:
        """The error for a failed exchange, naming the ranks that were not there."""
        missing = self._absent()
        first = (str(error).splitlines() or [""])[0]
        if missing is None:
            text = f"the exchange between ranks failed at {what} ({first})"
        elif missing:
            who = ", ".join(map(str, missing))
            text = (
                f"rank{'s' if len(missing) > 1 else ''} {who} did not answer within "
                f"{self.timeout:g} s (at {what}): stuck in another collective, busy elsewhere, "
                "or gone; every rank must reach the same checks"
            )
        else:
            text = f"every rank reached {what}, some later than {self.timeout:g} s ({first})"
        self.broken = text
        return RankError(text)

    def _absent(self) -> list[int] | None:
        """The ranks that did not mark this exchange in the store (None: no store)."""
        try:
            store = default_store()
            key = f"{self.uid}/{self.seq}/"
            store.set(key + str(self.rank), "here")
            deadline = time.monotonic() + GRACE
            missing = [r for r in range(self.world) if r != self.rank]
            while missing and time.monotonic() < deadline:
                missing = [r for r in missing if not store.check([key + str(r)])]
                if missing:
                    time.sleep(0.05)
        except Exception:
            return None
        return missing
