"""What a check is: the kinds of finding it reports, each with one line saying what it means,
and how `examine` runs it.

Every family declares its `Check`s beside the code that measures them, and its room's
`CHECKS` lists them; `isotrain.doctor.KINDS` is built from those, never kept by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from isotrain.doctor.ground.context import Context
from isotrain.doctor.ground.finding import Finding

__all__ = ["DOCTOR_ERROR", "Check", "Kind"]


@dataclass(frozen=True)
class Kind:
    """One kind of finding: its name (part of the API) and what it means, in one line."""

    name: str
    means: str


@dataclass(frozen=True)
class Check:
    """Kinds measured together by one `run`, from the state examine found (a reset before and
    after it); `fast=False` ones are skipped by checks="fast"; `traces=True` ones trace with
    torch.compile, every other runs the user's compiled code eagerly (hooks and op watches
    see every op, and no compile happens); `ranks=True` ones compare ranks and are left out
    of "all"/"fast" in a single process."""

    name: str
    kinds: tuple[Kind, ...]
    run: Callable[[Context], list[Finding]]
    fast: bool = True
    traces: bool = False
    ranks: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        """The names of the kinds this check reports."""
        return tuple(k.name for k in self.kinds)


DOCTOR_ERROR = Kind(
    "doctor_error", "a check raised: its first line, so the doctor itself never crashes"
)
