"""graph_retained: tensors of one step, with their autograd graph, still alive in the next.

The trace counts the graph nodes alive after each call of the user's step; a count that grows
call after call (and that a garbage collection does not take back) is a graph kept across
steps, and a second backward through a freed graph names the same bug.
"""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

from isotrain.doctor.ground.context import CannotRun, Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ground.trace import Trace, graph_alive, trace

__all__ = ["GRAPH_RETAINED", "check_graph_retained"]

_SECOND_BACKWARD = "backward through the graph a second time"


def check_graph_retained(ctx: Context) -> list[Finding]:
    """graph_retained: tensors (with their autograd graph) of one step alive into the next."""
    tr: Trace = trace(ctx)
    fix = (
        "keep what outlives the step detached: total_loss += loss.detach() (or loss.item() at "
        "log steps), hidden = hidden.detach() for state carried across steps, and no stored "
        "outputs that still require grad"
    )
    if tr.error is not None and _SECOND_BACKWARD in tr.error and tr.steps:
        last = tr.steps[-1]
        return [Finding(
            "graph_retained", "error", _common(last.retained) or last.backward_at,
            f"call {len(tr.steps) + 1} of your step raised {tr.error.split(' (')[0]}: its graph "
            "reaches into "
            "the previous step's, through a tensor carried across steps",
            fix + " (retain_graph=True only hides it: the graph then grows every step)",
        )]  # fmt: skip
    if tr.error is not None and not tr.steps:
        raise CannotRun(f"your step raised {tr.error}")
    nodes = [s.graph_nodes for s in tr.steps]
    if len(nodes) < 3 or not all(b > a for a, b in pairwise(nodes)):
        return []
    if graph_alive(tr.watch, collect=True)[0] < nodes[-1]:
        return []  # a reference cycle held them: garbage, not retained
    per = (nodes[-1] - nodes[0]) / (len(nodes) - 1)
    shown = ", ".join(map(str, nodes))
    return [Finding(
        "graph_retained", "warning", _common(tr.steps[-1].retained) or "your step",
        f"after each of {len(nodes)} calls of your step, tensors it made are still alive with "
        f"their autograd graph, and it grows: {shown} graph nodes (+{per:.0f} per step), so "
        "memory and time grow with every step",
        fix,
    )]  # fmt: skip


def _common(lines: list[str]) -> str | None:
    return Counter(lines).most_common(1)[0][0] if lines else None


GRAPH_RETAINED = Check(
    "graph_retained",
    (
        Kind(
            "graph_retained",
            "tensors with their autograd graph outlive the step; the graph grows",
        ),
    ),
    check_graph_retained,
)
