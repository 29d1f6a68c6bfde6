"""collective_mismatch: the user's own collectives, compared across ranks before they run.

While the doctor runs under a process group, each `torch.distributed` collective that code
outside torch calls on the whole world (`dist.all_reduce(t)`, `dist.all_gather(...)`, ...)
first sends its name, shapes and dtypes to every rank over the doctor's link. If they differ,
every rank raises `CollectiveMismatch` at that call, so none of them enters gloo/NCCL with a
tensor that does not fit: those fail deep inside, or hang, with no word of which call it was.
torch's own calls (DDP, FSDP) are consistent by construction and pass straight through; so do
calls on sub-groups, which only some ranks make.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from isotrain._torch_private import tree_leaves
from isotrain.doctor.ground.watch import DOCTOR_DIR, TORCH_DIR, user_site
from isotrain.doctor.ranks.link import Ranks

__all__ = ["CollectiveMismatch", "Collectives", "checking_collectives"]

_NAMES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "reduce", "all_to_all_single", "all_to_all",
    "gather", "scatter",
)  # fmt: skip
_UNEVEN = {"all_to_all_single", "all_to_all"}  # splits may differ by rank: dtypes only


class CollectiveMismatch(RuntimeError):
    """Ranks call one collective with tensors that do not fit together (raised on every rank)."""

    def __init__(self, where: str, evidence: str) -> None:
        super().__init__(f"a collective at {where} gets tensors that differ across ranks")
        self.where, self.evidence = where, evidence


@dataclass
class Collectives:
    """What the check saw: calls compared, and the first mismatch (where, evidence)."""

    ranks: Ranks
    calls: int = 0
    mismatch: tuple[str, str] | None = None


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _describe(name: str, bound: inspect.BoundArguments) -> tuple[Any, ...]:
    """The parts of a call every rank must agree on: tensors' dtypes (and shapes), op, root."""
    parts: list[Any] = []
    for arg, value in bound.arguments.items():
        if arg in ("group", "async_op", "group_src", "group_dst"):
            continue
        tensors = _tensors(value)
        if tensors:
            parts.append((arg, [
                (str(t.dtype).removeprefix("torch."), None if name in _UNEVEN else tuple(t.shape))
                for t in tensors
            ]))  # fmt: skip
        elif arg in ("op", "src", "dst") and value is not None:
            parts.append((arg, str(value)))
    return (name, tuple(parts))


def _text(desc: tuple[Any, ...]) -> str:
    """'tensor: (3,) int64' for one rank's call."""
    out = []
    for arg, value in desc[1]:
        if isinstance(value, list):
            shown = ", ".join(
                dtype if shape is None else f"{shape} {dtype}" for dtype, shape in value
            )
            out.append(f"{arg} {shown}")
        else:
            out.append(f"{arg}={value}")
    return "; ".join(out)


def _whole_world(bound: inspect.BoundArguments) -> bool:
    group = bound.arguments.get("group")
    return (
        group is None
        or group is dist.group.WORLD
        or dist.get_world_size(group) == (dist.get_world_size())
    )


def _compare(state: Collectives, name: str, desc: tuple[Any, ...], site: str) -> None:
    """Exchange this call's description; raise CollectiveMismatch on every rank if they differ."""
    state.calls += 1
    got = state.ranks.gather("a collective call", (desc, site), note=f"{name} at {site}")
    descs = [d for d, _ in got]
    if all(d == descs[0] for d in descs):
        return
    sites = sorted({s for _, s in got})
    names = sorted({d[0] for d in descs})
    per_rank = "; ".join(f"rank {r}: {d[0]}({_text(d)})" for r, d in enumerate(descs))
    what = names[0] if len(names) == 1 else " / ".join(names)
    evidence = (
        f"{what} gets tensors that do not fit across ranks ({per_rank}): run for real, gloo "
        "or NCCL fails or hangs inside it with no message"
    )
    where = ", ".join(sites)
    state.mismatch = state.mismatch or (where, evidence)
    raise CollectiveMismatch(where, evidence)


def _checked(fn: Callable[..., Any], name: str, state: Collectives) -> Callable[..., Any]:
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_code.co_filename
        if caller.startswith((TORCH_DIR, DOCTOR_DIR)):
            return fn(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return fn(*args, **kwargs)  # torch says what is wrong with the call itself
        if _whole_world(bound):
            _compare(state, name, _describe(name, bound), user_site().where)
        return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def checking_collectives(ranks: Ranks) -> Iterator[Collectives]:
    """Inside the block, `torch.distributed`'s collectives are compared across ranks first."""
    state = Collectives(ranks)
    saved = {n: getattr(dist, n) for n in _NAMES if callable(getattr(dist, n, None))}
    for name, fn in saved.items():
        setattr(dist, name, _checked(fn, name, state))
    try:
        yield state
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
