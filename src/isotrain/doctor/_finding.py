"""What the doctor reports: one `Finding` per problem, a `Diagnosis` holding them all.

`KINDS` is the list of every kind the doctor can report, with one line saying what it means;
the README's list and `examine(checks=[...])` validation both read it.
"""

from __future__ import annotations

import textwrap
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = ["KINDS", "Diagnosis", "Finding", "Severity"]

Severity = Literal["error", "warning", "info"]
_ORDER = {"error": 0, "warning": 1, "info": 2}

KINDS: dict[str, str] = {
    "host_sync": "an op in the step forces a host-device sync (.item(), nonzero, mask indexing)",
    "mode_leak": "after eval_fn or the step, a submodule's train/eval flag differs from before",
    "grad_mode_leak": "after eval_fn or the step, grad mode (or inference mode) differs",
    "autocast_leak": "after eval_fn or the step, autocast is on, off or of another dtype",
    "global_state_leak": "default dtype, deterministic flags, threads or subnormals changed",
    "eval_in_train_mode": "eval_fn ran dropout or BatchNorm in training mode",
    "buffer_write_in_eval": "eval_fn changed a buffer (BatchNorm running statistics)",
    "rng_leak": "running eval_fn between two steps changes the training that follows",
    "unused_parameter": "a parameter with requires_grad receives no gradient",
    "parameter_not_in_optimizer": "a trainable parameter the optimizer does not hold",
    "frozen_parameter_in_optimizer": "a step moves a parameter with requires_grad=False",
    "duplicate_parameter": "one tensor appears twice in the optimizer's groups",
    "weight_decay_on_norm_or_bias": "weight decay applies to norm weights or biases (info)",
    "params_unchanged": "a parameter the optimizer holds does not change in a step",
    "cannot_overfit": "the loss on one repeated batch falls neither at your LR nor at 10x",
    "loss_at_init": "the first loss is far from ln(number of classes)",
    "batch_mixing": "one sample's input changes another sample's output",
    "causal_leak": "changing token t changes the logits at positions before t",
    "nonfinite_forward": "the first module whose output is NaN or Inf",
    "overflow_risk": "activations, softmax, exp or log inputs near overflow or underflow",
    "nondeterminism": "the same step from the same state and seed gives another result",
    "graph_break": "torch.compile splits a block's graph, with the reasons",
    "recompile": "your batches make torch.compile compile again (varying shapes)",
    "memory": "saved activation bytes per block and the checkpointing policy that halves them",
    "labels_not_shifted": "a language model's targets equal its input tokens at the same position",
    "padding_in_loss": "labels where the attention mask is 0 are not the loss's ignore index",
    "loss_broadcast": "an elementwise loss's input and target differ in shape and broadcast",
    "softmax_before_loss": "cross_entropy or nll_loss receive probabilities, not logits",
    "graph_retained": "tensors with their autograd graph outlive the step; the graph grows",
    "stale_gradient": "optimizer.step() receives earlier steps' gradients too (no zero_grad)",
    "accumulation_scale": "with k micro-batches the applied gradient is k (or 1/k) times the mean",
    "batch_size_mismatch": "the tensors of one batch disagree on how many samples it holds",
    "autocast_not_applied": "inside an autocast region, matmul-class ops run in float32",
    "lr_collapse": "the learning rate falls more than 100x within the examined steps",
    "dataloader_worker_seed": "DataLoader workers share a random state: augmentations repeat",
    "doctor_error": "a check raised: its first line, so the doctor itself never crashes",
    "replica_divergence": "a replicated parameter, or a buffer no step writes, differs across "
    "data-parallel ranks (which one, which ranks, the largest difference)",
    "gradient_not_synchronized": "after backward, a data-parallel model's gradients differ "
    "across ranks (DDP hooks on replaced parameters, the wrapper bypassed, no_sync left on)",
    "same_data_on_ranks": "ranks got byte-identical batches (no DistributedSampler, data not "
    "split by rank)",
    "collective_mismatch": "ranks call a collective with tensors of other shapes or dtypes, or "
    "reach collectives in another order (compared before the collective runs)",
    "lost_update": "Monitor: the gradients optimizer.step() applied differ across ranks (an "
    "all-reduce's result differed)",
    "nonfinite_grad": "Monitor: optimizer.step() got NaN/Inf gradients (an error once a "
    "parameter holds NaN/Inf)",
    "lr_off_schedule": "Monitor: a step's learning rate is not the one its schedule gives",
}


@dataclass(frozen=True)
class Finding:
    """One problem: its kind, how bad, where (module, parameter or file:line), the measured
    evidence, and what to change.

    Example: ``Finding("mode_leak", "error", "model.drop", "train -> eval", "use eval_mode")``
    """

    kind: str
    severity: Severity
    where: str
    evidence: str
    fix: str

    def __post_init__(self) -> None:
        if self.severity not in _ORDER:
            raise ValueError(f"severity must be error, warning or info, got {self.severity!r}")


@dataclass
class Diagnosis:
    """Every finding of one `examine` call, errors first; `ok` when none is an error.

    Example: ``d = examine(model, opt, batches, loss_fn=f); print(d); assert d.ok``
    """

    findings: list[Finding] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)  # the kinds examined
    seconds: float = 0.0

    def __post_init__(self) -> None:
        self.findings = sorted(self.findings, key=lambda f: (_ORDER[f.severity], f.kind))

    @property
    def ok(self) -> bool:
        """True when no finding has severity "error"."""
        return not any(f.severity == "error" for f in self.findings)

    def of(self, kind: str) -> list[Finding]:
        """The findings of one kind."""
        return [f for f in self.findings if f.kind == kind]

    def summary(self) -> str:
        """One line: counts by severity, checks run, time."""
        n = {s: sum(f.severity == s for f in self.findings) for s in _ORDER}
        return (
            f"{n['error']} error(s), {n['warning']} warning(s), {n['info']} info "
            f"({len(self.checks)} kinds examined in {self.seconds:.1f} s)"
        )

    def table(self, *, width: int = 100, color: bool = False) -> str:
        """The findings as a table: severity, kind and where on one line, evidence and fix
        wrapped under it; `color` adds ANSI colors for a terminal."""
        paint = {"error": "\033[31m", "warning": "\033[33m", "info": "\033[36m"}
        lines = [f"{'SEVERITY':<8} {'KIND':<29} WHERE"]
        pad = " " * 9
        for f in self.findings:
            sev = f"{f.severity.upper():<8}"
            if color:
                sev = f"{paint[f.severity]}{sev}\033[0m"
            lines.append(f"{sev} {f.kind:<29} {f.where}")
            for label, text in (("evidence", f.evidence), ("fix", f.fix)):
                if text == "-":
                    continue
                lines += textwrap.wrap(
                    f"{label}: {text}", width, initial_indent=pad, subsequent_indent=pad + "  "
                )
        if not self.findings:
            lines.append("(no findings)")
        lines.append(self.summary())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_json(self) -> dict[str, Any]:
        """A dict that json.dumps accepts: ok, the summary, the kinds examined, the findings."""
        return {
            "ok": self.ok,
            "summary": self.summary(),
            "seconds": self.seconds,
            "checks": list(self.checks),
            "findings": [asdict(f) for f in self.findings],
        }
