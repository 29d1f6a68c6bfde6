"""Gradients across steps: the one optimizer.step() applies against the doctor's own fresh
gradient of the same samples (NOTE [reference gradient] in _trace), and autograd graphs
that outlive their step."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

from isotrain.doctor._context import CannotRun, Context
from isotrain.doctor._finding import Finding
from isotrain.doctor._trace import StepTrace, Trace, graph_alive, trace, trace_ok

__all__ = ["check_accumulation", "check_graph_retained", "check_stale"]

_FIT = 0.1  # the largest relative residual of a fit that concludes anything
_SECOND_BACKWARD = "backward through the graph a second time"


def _fitted(ctx: Context) -> list[StepTrace]:
    """The calls whose gradient the doctor could judge, or CannotRun saying why none."""
    tr = trace_ok(ctx)
    steps = tr.steps
    if tr.reference_error is not None:
        raise CannotRun(f"the doctor cannot differentiate the loss itself: {tr.reference_error}")
    if any(s.closure for s in steps):
        raise CannotRun("optimizer.step(closure) evaluates the loss itself")
    counts = sorted({s.optimizer_steps for s in steps})
    if counts != [1]:
        raise CannotRun(
            f"your step calls optimizer.step() {' or '.join(map(str, counts))} time(s) per "
            "call (accumulation across calls is yours to judge)"
        )
    if not any(s.references for s in steps):
        raise CannotRun(
            "no mean-reduced loss-function call (cross_entropy, nll_loss, mse_loss, l1_loss, "
            "smooth_l1_loss, huber_loss) feeds your backward"
        )
    return [s for s in steps if s.fit is not None and s.fit.residual < _FIT]


def check_stale(ctx: Context) -> list[Finding]:
    """stale_gradient: step() receives the fresh gradient plus what an earlier step left."""
    for s in _fitted(ctx):
        f = s.fit
        if s.index == 0 or f is None or f.before_norm < 0.05 or abs(f.b - 1) > 0.2:
            continue
        return [Finding(
            "stale_gradient", "error", s.step_at,
            f"at call {s.index + 1} of your step, optimizer.step() received the fresh gradient "
            f"of its batch plus {f.b:.2f} x the gradient left in .grad by the step before "
            f"(|left| = {f.before_norm:.2g} x |fresh|, fit residual {f.residual:.1%}): "
            "gradients add up across steps",
            "call optimizer.zero_grad() once per optimizer step, before the forward or right "
            "after optimizer.step(); with gradient accumulation, after the step that ends it",
        )]  # fmt: skip
    return []


def check_accumulation(ctx: Context) -> list[Finding]:
    """accumulation_scale: with k micro-batches, the applied gradient is k (or 1/k) times their
    mean gradient."""
    for s in _fitted(ctx):
        k, f = s.references, s.fit
        if k < 2 or f is None:
            continue
        a = f.a / s.scale
        if abs(a / k - 1) < 0.25:
            how = "each micro-batch's loss.backward() adds its full mean gradient"
            fix = (
                "divide each micro-batch loss by the number of micro-batches: (loss / k).backward()"
            )
        elif abs(a * k - 1) < 0.25:
            how = "the loss is divided by the number of micro-batches twice"
            fix = (
                "divide once: drop your own division when a library divides too (HF Trainer "
                "gradient_accumulation_steps, Accelerate's accumulate, Lightning "
                "accumulate_grad_batches)"
            )
        else:
            continue
        return [Finding(
            "accumulation_scale", "error", s.backward_at,
            f"{k} micro-batches per optimizer step: the gradient accumulated for step() is "
            f"{a:.3g} x the mean gradient of the same {k} micro-batches (the doctor's own "
            f"gradient of each micro-batch's loss), not 1: {how}",
            fix,
        )]  # fmt: skip
    return []


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
