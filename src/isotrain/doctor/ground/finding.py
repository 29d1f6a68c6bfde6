"""What the doctor reports: one `Finding` per problem, a `Diagnosis` holding them all."""

from __future__ import annotations

import textwrap
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = ["Diagnosis", "Finding", "Severity"]

Severity = Literal["error", "warning", "info"]
_ORDER = {"error": 0, "warning": 1, "info": 2}


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
