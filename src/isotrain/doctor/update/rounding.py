"""Whether each float16/bfloat16 parameter keeps the update its optimizer's rule gives, in
float32, for the gradient step() received (NOTE [the rule's update] in update.rule): an update
below half the spacing of the parameter's numbers rounds away. A value the step turned NaN/Inf
is numerics' optimizer_eps_underflow (the step's arithmetic in that dtype), not counted here."""

from __future__ import annotations

from dataclasses import dataclass, field

from isotrain.doctor.ground.context import CannotRun, Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.update.params import name_list
from isotrain.doctor.update.rule import LOW, Stepped, judged, norm, rule

__all__ = ["ROUNDING", "check_rounding"]

_MOST = 0.5  # a tensor that loses this much of its update's size does not train
_NOTABLE = 0.1  # the share of the whole update's size lost that is worth a warning


@dataclass
class _Lost:
    """What rounding took, summed over the judged float16/bfloat16 parameters."""

    moves: int = 0  # elements the rule moves (and the step left finite)
    still: int = 0  # of them, those whose stored value did not change
    size: float = 0.0  # |u| summed over the elements the rule moves
    lost: float = 0.0  # ... over those still
    tensors: dict[str, float] = field(default_factory=dict)  # name -> share of its update lost

    def add(self, name: str, s: Stepped, i: int) -> None:
        pre, post, u = s.pre[i], s.post[i], s.rule[i]
        moves = (u != 0) & u.isfinite() & pre.isfinite() & post.isfinite()
        still = moves & (post == pre)
        size = u.double().abs()
        total, lost = float(size[moves].sum()), float(size[still].sum())
        self.moves += int(moves.sum())
        self.still += int(still.sum())
        self.size, self.lost = self.size + total, self.lost + lost
        if total:
            self.tensors[name] = max(self.tensors.get(name, 0.0), lost / total)


def check_rounding(ctx: Context) -> list[Finding]:
    """update_lost_to_rounding: error when half the update's size is lost, warning from a tenth
    or when a tensor loses half of its own (it does not train); an optimizer that rounds
    stochastically or keeps the remainder in its state loses none."""
    r = rule(ctx)
    low = {id(s): [i for i in s.pre if s.pre[i].dtype in LOW] for s in r.steps}
    if not any(low.values()):
        return []
    r = judged(ctx)
    failed = next((s.error for s in r.steps if low[id(s)] and s.error is not None), None)
    if failed is not None:
        raise CannotRun(failed)
    found = _Lost()
    for s in r.steps:
        if low[id(s)] and not _stochastic(s, low[id(s)]):
            for i in low[id(s)]:
                if not _compensated(s, i):
                    found.add(r.names.get(i, "?"), s, i)
    share = found.lost / found.size if found.size else 0.0
    stuck = sorted(
        (n for n, v in found.tensors.items() if v >= _MOST), key=found.tensors.__getitem__
    )
    if share < _NOTABLE and not stuck:
        return []
    s0 = next(s for s in r.steps if low[id(s)])
    dtype = str(s0.pre[low[id(s0)][0]].dtype).removeprefix("torch.")
    named = stuck[::-1] or sorted(found.tensors, key=found.tensors.__getitem__, reverse=True)
    return [Finding(
        "update_lost_to_rounding", "error" if share >= _MOST else "warning", s0.where,
        f"at call {r.call + 1} of your step, of the {found.moves} elements of {dtype} "
        f"parameters the optimizer's rule (replayed in float32) moves, {found.still} kept their "
        f"stored value: {share:.0%} of the update's size is lost, and {len(stuck)} "
        f"tensor(s) lost half of theirs or more ({name_list(named)}): an update below half the "
        f"spacing of {dtype} numbers at its weight rounds away",
        "keep the parameters in float32 (master weights) and run the forward under "
        "torch.autocast(device_type, dtype=torch.bfloat16); or step them with an optimizer that "
        "compensates (Kahan summation, or stochastic rounding as torchao's "
        "AdamW(bf16_stochastic_round=True))",
    )]  # fmt: skip


def _stochastic(s: Stepped, ids: list[int]) -> bool:
    """Whether s's optimizer rounds stochastically: where round-to-nearest would leave the
    stored value as it was, the values still moved (in the rule's direction) by at least a
    quarter of the rule's update; an unbiased rounding moves them by all of it on average."""
    moved = expected = 0.0
    for i in ids:
        pre, post, u = s.pre[i], s.post[i], s.rule[i]
        kept = (u != 0) & ((pre.float() + u).to(pre.dtype) == pre) & post.isfinite()
        step = (post.double() - pre.double()) * u.double().sign()
        moved += float(step[kept].sum())
        expected += float(u.double()[kept].abs().sum())
    return expected > 0 and moved >= 0.25 * expected


def _compensated(s: Stepped, i: int) -> bool:
    """Whether the optimizer's state keeps what rounding lost of this parameter's update (a
    Kahan-summation buffer): a state tensor shaped like it holding +-(pre + u - post)."""
    still = (s.rule[i] != 0) & (s.post[i] == s.pre[i])
    rest = (s.pre[i].double() + s.rule[i].double() - s.post[i].double())[still]
    if not rest.numel():
        return False
    near = 0.5 * norm(rest)
    return any(
        min(norm(t.double()[still] - rest), norm(t.double()[still] + rest)) <= near
        for t in s.kept.get(i, [])
    )


ROUNDING = Check(
    "update_lost_to_rounding",
    (
        Kind(
            "update_lost_to_rounding",
            "a float16/bfloat16 parameter's update rounds away: its stored value does not move",
        ),
    ),
    check_rounding,
)
