"""Loss terms that train nothing: a torch.nn.functional loss that a backward differentiates
whose gradient reaches no parameter a step then updates with it (NOTE [loss terms] in
update.reach), while the rest of that loss trains."""

from __future__ import annotations

from dataclasses import dataclass

from isotrain.doctor.ground.context import CannotRun, Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.update.params import name_list
from isotrain.doctor.update.reach import Reach, Use, reach

__all__ = ["TERMS", "check_terms"]


@dataclass
class _Verdict:
    """One term's line (by the user's lines it was called through), over the watched calls."""

    dead: list[Use]
    trained: int = 0


def _judge(r: Reach) -> dict[tuple[str, tuple[str, ...]], _Verdict]:
    verdicts: dict[tuple[str, tuple[str, ...]], _Verdict] = {}
    for u in r.uses:
        b = r.backwards[u.backward]
        if not b.applied:  # the whole backward trains nothing: unused_parameter's
            continue
        v = verdicts.setdefault((u.term.name, u.term.chain), _Verdict([]))
        if u.held & b.applied:
            v.trained += 1
        elif u.judged and all(pid in b.lost for pid in u.held):
            v.dead.append(u)
    return verdicts


def check_terms(ctx: Context) -> list[Finding]:
    """loss_term_unused: a loss term in a backward that trains nothing a step updates."""
    r = reach(ctx)
    if r.error is not None and not r.calls:
        raise CannotRun(f"your step raised {r.error}")
    return [_finding(r, v.dead, r.calls) for v in _judge(r).values() if v.dead and not v.trained]


def _owned(r: Reach, pids: list[int]) -> str:
    owners = sorted({i for pid in pids for i in r.owners.get(pid, [])})
    return ", ".join(f"optimizer {i}" for i in owners) + "'s"


def _finding(r: Reach, dead: list[Use], calls: int) -> Finding:
    u = dead[0]
    b = r.backwards[u.backward]
    t = u.term
    names = r.names.get
    order = {pid: i for i, pid in enumerate(r.names)}
    via = f" (called from {', '.join(t.chain[1:3])})" if len(t.chain) > 1 else ""
    head = f"{t.name} at {t.where}{via} is a term of the loss backwarded at {b.where}"
    trained = sorted(b.applied, key=lambda pid: order.get(pid, len(order)))
    rest = (
        f"; that backward trained {len(trained)} parameter(s) through the rest of its loss "
        f"({name_list([names(p, '?') for p in trained])}, {_owned(r, trained)}), so the loss "
        f"you read holds a term the update ignores ({len(dead)} of {calls} call(s) of your step)"
    )
    if not t.graph:
        return Finding(
            "loss_term_unused", "error", t.where,
            f"{head}, but it has no autograd graph: every input was cut from the parameters "
            "before the call (a .detach(), torch.no_grad(), a tensor rebuilt from values, or "
            f"only frozen parameters behind it), so its gradient reaches no parameter and the "
            f"term trains nothing{rest}",
            "remove the cut between this term and the network it should train: score D(fake), "
            "not D(fake).detach() or D(fake.detach()), and no torch.no_grad() around it (a "
            "discriminator frozen with requires_grad_(False) still passes the gradient on to "
            "G); a term kept only for logging belongs outside the loss you backward",
        )  # fmt: skip
    lost = sorted(u.held, key=lambda pid: order.get(pid, len(order)))
    clear_at, steps_then = min(b.lost[pid] for pid in lost)
    stepped = list(dict.fromkeys(r.steps[b.steps : steps_then]))
    steps = ", ".join(f"optimizer {i}'s step at {line}" for i, line in stepped)
    return Finding(
        "loss_term_unused", "error", t.where,
        f"{head}, and its gradient reaches only {name_list([names(p, '?') for p in lost])} "
        f"({_owned(r, lost)}), which {steps} did not update, and which the zero_grad at "
        f"{clear_at} cleared before any step of theirs applied it: the term trains "
        f"nothing{rest}",
        "remove the cut between this term and the network it should train (a GAN's "
        "generator loss needs D(fake), not D(fake.detach())), or step the optimizer that "
        "holds what it reaches before that zero_grad; a term kept only for logging belongs "
        "outside the loss you backward",
    )  # fmt: skip


TERMS = Check(
    "loss terms",
    (
        Kind(
            "loss_term_unused",
            "a loss term in a backward reaches no parameter a step then updates with it",
        ),
    ),
    check_terms,
)
