"""Each loss against its input contract: the space its input must be in (logits, probabilities,
log-probabilities), the range of its targets, the shape its weights broadcast along, and the
losses the doctor cannot read.

It reads every torch loss call of one call of the user's step (`seen_calls`), with the value
range of each argument and the op that made it.
"""

from __future__ import annotations

from isotrain.doctor.ground.context import Context
from isotrain.doctor.ground.finding import Finding, Severity
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.losses.seen import SeenCall, TensorSeen, seen_calls

__all__ = ["LOSS_CONTRACT", "check_contract"]

_TOL = 1e-3  # how far a float32 row may sum from 1 (or logsumexp from 0) and be a distribution
_MIN_VALUES = 32  # fewer values than this say nothing about their range
_READ = {"cross_entropy", "nll_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
         "kl_div", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss"}  # fmt: skip
_LOG_INPUT = {"nll_loss", "kl_div"}  # input must be log-probabilities
_FIX_LOGITS = {
    "cross_entropy": "pass the logits: drop the softmax before the loss (nn.Softmax as the last "
    "layer or F.softmax) and apply it only for predictions",
    "nll_loss": "use F.log_softmax instead of F.softmax before nll_loss (or pass logits to "
    "F.cross_entropy)",
    "binary_cross_entropy_with_logits": "pass the logits: drop the sigmoid before the loss "
    "(nn.Sigmoid as the last layer or torch.sigmoid), and apply it only for predictions; or "
    "keep the sigmoid and use F.binary_cross_entropy",
    "kl_div": "give kl_div log-probabilities as its input: F.log_softmax(student_logits / T, "
    "dim=-1), not F.softmax",
}


def _tol(t: TensorSeen) -> float:
    """How far a row may sum from 1 (or logsumexp from 0) in the tensor's dtype."""
    return 2e-2 if t.low_precision else _TOL


def _is_probabilities(t: TensorSeen, *, rows: bool) -> bool:
    """All values in [0, 1] (and, with `rows`, every class row sums to 1)."""
    if not t.floating or t.low < 0 or t.high > 1 + _tol(t):
        return False
    return t.row_sum_off <= _tol(t) if rows else True


def _is_log_probabilities(t: TensorSeen) -> bool:
    """All values at most 0 and every class row's logsumexp 0 (a log_softmax's output)."""
    return t.floating and t.high <= _tol(t) and t.row_lse_off <= _tol(t)


def _made(t: TensorSeen) -> str:
    """Evidence of the op that made the tensor, when the watch saw it."""
    return f"; the {t.made_by[0]} at {t.made_by[1]} made it" if t.made_by else ""


def _range(t: TensorSeen) -> str:
    """The tensor's value range, for the evidence."""
    return f"all {t.numel} values in [{t.low:.3g}, {t.high:.3g}]"


def _probabilities_in(call: SeenCall) -> Finding | None:
    """softmax_before_loss: probabilities where the loss takes logits or log-probabilities."""
    x = call.tensors.get("input")
    if x is None or call.name not in _FIX_LOGITS:
        return None
    if call.name == "binary_cross_entropy_with_logits":
        squashed = x.made_by is not None and x.made_by[0] in ("sigmoid", "softmax")
        if not (_is_probabilities(x, rows=False) and (squashed or x.numel >= _MIN_VALUES)):
            return None
        what, why = "logits", "it applies the sigmoid itself, so the sigmoid runs twice: its "
        why += "outputs stay in [0.5, 0.73] and the gradient is squashed"
        sev: Severity = "error" if squashed else "warning"
        rows = ""
    else:
        if not _is_probabilities(x, rows=True) or len(x.shape) == 0:
            return None
        what = "logits" if call.name == "cross_entropy" else "log-probabilities"
        why = {
            "cross_entropy": "cross_entropy applies log_softmax itself, so the softmax runs "
            "twice and squashes the gradient",
            "nll_loss": "nll_loss takes log-probabilities, so its loss is -p, not -log p",
            "kl_div": "kl_div takes log-probabilities as its input, so it computes "
            "sum q (log q - p): not a divergence, and it can go negative",
        }[call.name]
        sev, rows = "error", " and every row sums to 1"
    return Finding(
        "softmax_before_loss", sev, x.made_by[1] if x.made_by else call.where,
        f"{call.name} called at {call.where} received probabilities, not {what}: "
        f"{_range(x)}{rows}{_made(x)}; {why}",
        _FIX_LOGITS[call.name],
    )  # fmt: skip


def _log_input(call: SeenCall) -> list[Finding]:
    """not_log_probabilities: nll_loss or kl_div's input is neither log-probabilities nor
    probabilities (those are softmax_before_loss): logits."""
    x = call.tensors.get("input")
    if call.name not in _LOG_INPUT or x is None or not x.floating or x.numel < 2:
        return []
    if _is_log_probabilities(x) or _is_probabilities(x, rows=True):
        return []
    sev: Severity = "error" if x.high > _TOL else "warning"
    seen = (
        f"{x.high:.3g} is above 0 (a log-probability never is)"
        if x.high > _TOL
        else f"its rows' logsumexp is off 0 by up to {x.row_lse_off:.3g}"
    )
    return [Finding(
        "not_log_probabilities", sev, call.where,
        f"{call.name}'s input is not log-probabilities: {seen}{_made(x)}; {call.name} takes "
        "-x at the target without normalizing, so the loss falls without bound by growing "
        "the logits",
        "apply F.log_softmax(logits, dim=<the class dim>) before the loss, or pass the logits "
        "to F.cross_entropy (for kl_div: F.log_softmax of the student's logits)",
    )]  # fmt: skip


def _kl_target(call: SeenCall) -> list[Finding]:
    """not_log_probabilities: kl_div's target is in the other space than log_target says."""
    y = call.tensors.get("target")
    if call.name != "kl_div" or y is None or not y.floating:
        return []
    if not call.options.get("log_target") and y.low < -_TOL and _is_log_probabilities(y):
        return [Finding(
            "not_log_probabilities", "error", call.where,
            "kl_div: its target is log-probabilities (every row's logsumexp is 0) but "
            f"log_target=False, so it reads them as probabilities: {_range(y)}",
            "pass log_target=True, or give the target as probabilities (F.softmax)",
        )]  # fmt: skip
    if call.options.get("log_target") and _is_probabilities(y, rows=True) and y.numel >= 2:
        return [Finding(
            "not_log_probabilities", "error", call.where,
            f"kl_div: log_target=True but its target is probabilities: {_range(y)} and every "
            "row sums to 1",
            "pass log_target=False, or give the target as log-probabilities (F.log_softmax)",
        )]  # fmt: skip
    return []


def _target_range(call: SeenCall) -> Finding | None:
    """target_out_of_range: binary targets outside [0, 1]; soft class targets that are not
    distributions (cross_entropy with float targets of the input's shape, kl_div's target)."""
    x, y = call.tensors.get("input"), call.tensors.get("target")
    if x is None or y is None or not y.floating:
        return None
    if call.name in ("binary_cross_entropy", "binary_cross_entropy_with_logits"):
        if y.low >= -_TOL and y.high <= 1 + _TOL:
            return _scaled_labels(call, y)
        return Finding(
            "target_out_of_range", "error", call.where,
            f"{call.name}'s targets lie in [{y.low:.3g}, {y.high:.3g}], outside [0, 1]: the "
            "loss has no minimum there (it falls without bound, or goes negative) and the "
            "model is pushed toward the extremes",
            "scale the targets to [0, 1] (a 0/255 mask: mask / 255 or (mask > 0).float(), "
            "applied to the target, not only to the image)",
        )  # fmt: skip
    soft_ce = call.name == "cross_entropy" and y.shape == x.shape
    if not (soft_ce or (call.name == "kl_div" and not call.options.get("log_target"))):
        return None
    if y.low < -_TOL or y.high > 1 + _TOL:
        sev: Severity = "error"
        seen = f"values in [{y.low:.3g}, {y.high:.3g}], outside [0, 1]"
    elif y.row_sum_off > 1e-2 and soft_ce:
        sev, seen = "warning", f"rows that sum to 1 +- {y.row_sum_off:.3g}, not 1"
    else:
        return None
    return Finding(
        "target_out_of_range", sev, call.where,
        f"{call.name}'s float targets are read as class probabilities but have {seen}",
        "for class ids pass a long tensor of shape (N,); for soft labels normalize each row "
        "to sum to 1; several labels per sample (multi-hot) want "
        "F.binary_cross_entropy_with_logits",
    )  # fmt: skip


# NOTE [scaled hard labels]
# A binary loss's hard labels are 0 and 1. Targets holding 0 and one other value, itself below
# 1/2 (and at least _MIN_VALUES of them), are a 0/1 mask scaled on the way: ToTensor divides a
# uint8 array by 255, so the positive class becomes 1/255 and the loss trains the model to
# predict 0 everywhere. Label smoothing keeps its positive label above 1/2, and soft targets
# (a heatmap, a teacher's probabilities) hold more than _FEW values: neither is named.
def _scaled_labels(call: SeenCall, y: TensorSeen) -> Finding | None:
    """target_out_of_range: binary targets {0, v} with 0 < v < 1/2 (NOTE [scaled hard labels])."""
    if len(y.values) != 2 or y.values[0] != 0 or not 0 < y.values[1] < 0.5 or y.numel < _MIN_VALUES:
        return None
    v = y.values[1]
    scale = f" = 1/{1 / v:.4g}" if abs(1 / v - round(1 / v)) < 1e-3 else ""
    return Finding(
        "target_out_of_range", "error", call.where,
        f"{call.name}'s targets hold only the values 0 and {v:.4g}{scale}: hard 0/1 labels "
        "scaled on the way (ToTensor divides a uint8 mask by 255), so the positive class's "
        f"target is {v:.4g} and the loss trains the model to predict about 0 everywhere",
        "keep the mask out of the image transform: torch.as_tensor(np.array(mask), "
        "dtype=torch.float32) (or (mask > 0).float()) for 0/1 labels; transforms.v2 leaves a "
        "tv_tensors.Mask unscaled",
    )  # fmt: skip


def _weight_shape(call: SeenCall) -> list[Finding]:
    """loss_weight_shape: a per-class weight that broadcasts along the last dimension of an
    (N, C, d1, ..., dk) input whose classes are along dim 1."""
    x = call.tensors.get("input")
    if x is None or len(x.shape) <= 2 or call.name not in (
        "binary_cross_entropy", "binary_cross_entropy_with_logits"
    ):  # fmt: skip
        return []
    out = []
    for key in ("pos_weight", "weight"):
        w = call.tensors.get(key)
        if w is None or len(w.shape) != 1 or w.shape[0] < 2:
            continue
        C = w.shape[0]
        if x.shape[1] == C and x.shape[-1] == C:
            out.append(Finding(
                "loss_weight_shape", "warning", call.where,
                f"{call.name}'s {key} has shape ({C},) against an input of shape {x.shape} "
                f"whose classes are along dim 1: it broadcasts along the last dimension "
                f"(also {C} long), so each class's weight lands on a column, not on the class",
                f"give it the class layout: {key}.view({C}, {', '.join('1' * (len(x.shape) - 2))})",
            ))  # fmt: skip
    return out


def _unread(calls: list[SeenCall]) -> list[Finding]:
    """loss_unread: no torch loss function in the step, or one whose contract is not read."""
    if not calls:
        return [Finding(
            "loss_unread", "info", "your step",
            "no torch loss function ran in your step (a loss written by hand or from another "
            "library): its input contract (logits, probabilities, target range) is not checked",
            "-",
        )]  # fmt: skip
    names = sorted({c.name for c in calls} - _READ)
    return [Finding(
        "loss_unread", "info", next(c.where for c in calls if c.name == name),
        f"F.{name}: the doctor does not read this loss's input contract (its input's space, "
        "its targets' range), so it is not checked",
        "-",
    ) for name in names]  # fmt: skip


def check_contract(ctx: Context) -> list[Finding]:
    """softmax_before_loss, not_log_probabilities, target_out_of_range, loss_weight_shape,
    loss_unread: each loss call of the step against its input contract."""
    seen = seen_calls(ctx)
    ctx.refuse(seen.error and f"your step raised {seen.error}")
    out: list[Finding] = []
    for call in seen.calls:
        out += [f for f in (_probabilities_in(call), _target_range(call)) if f is not None]
        out += _log_input(call) + _kl_target(call) + _weight_shape(call)
    out += _unread(seen.calls)
    return list({(f.kind, f.where, f.evidence): f for f in out}.values())


LOSS_CONTRACT = Check(
    "loss_contract",
    (
        Kind(
            "softmax_before_loss",
            "a loss that takes logits or log-probabilities (cross_entropy, nll_loss, "
            "BCE-with-logits, kl_div) receives probabilities",
        ),
        Kind(
            "not_log_probabilities",
            "nll_loss or kl_div's input is not log-probabilities, or kl_div's target is in "
            "the other space than log_target says",
        ),
        Kind(
            "target_out_of_range",
            "binary targets outside [0, 1] or hard 0/1 labels scaled below 1, or soft class "
            "targets that are not distributions",
        ),
        Kind(
            "loss_weight_shape",
            "a per-class weight of a BCE loss broadcasts along the last dimension, not the classes",
        ),
        Kind("loss_unread", "a loss the doctor cannot read, so its contract is not checked (info)"),
    ),
    check_contract,
)
