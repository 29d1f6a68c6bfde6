"""What a run shows: a bar that fits the terminal, plain lines elsewhere, every field whole."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from isotrain.train.report.progress import Progress, Reporter

TYPICAL = Progress(120, 500, 2.123456, 2e-3, 15234.0, 1, 296.0)
HUGE = Progress(999_999, 1_000_000, 12.3456, 1.23e-4, 1_234_567.0, 12_345, 123 * 3600.0 + 2767)


def _render(p: Progress, width: int) -> str:
    out = io.StringIO()
    Console(file=out, width=width, force_terminal=True, color_system=None).print(p)
    return out.getvalue()


@pytest.mark.parametrize("width", [80, 60, 50])
@pytest.mark.parametrize("p", [TYPICAL, HUGE], ids=["typical", "huge"])
def test_bar_fits_the_width_and_never_cuts_a_field(p, width) -> None:
    text = _render(p, width)
    lines = text.rstrip("\n").split("\n")
    assert len(lines) == 1 and len(lines[0]) <= width
    assert "…" not in text
    fields = p.fields()
    shown = [f for f in fields if f in lines[0]]
    # step, loss and ETA always; the others whole or not at all (never a prefix of one)
    assert {fields[0], fields[1], fields[-1]} <= set(shown)
    words = set(re.sub("[━─]+", " ", lines[0]).split())
    assert words <= {w for f in shown for w in f.split()}


def test_at_80_columns_a_typical_run_shows_every_field_and_a_bar() -> None:
    line = _render(TYPICAL, 80).rstrip("\n")
    assert line.startswith("step 120/500 ━")
    for field in TYPICAL.fields():
        assert field in line
    assert line.endswith(" loss 2.1235 lr 2.0e-03 15.2k tok/s skips 1 eta 0:04:56")
    bar = re.search("[━─]+", line)
    assert bar is not None and 10 <= len(bar.group()) <= 30
    assert bar.group().count("━") == round(len(bar.group()) * 120 / 500)


def _reporter(terminal: bool, live: bool = True) -> tuple[Reporter, io.StringIO]:
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=terminal, color_system=None)
    return Reporter(total_steps=10, enabled=True, live=live, console=console), out


def test_without_a_terminal_each_log_step_is_one_plain_line() -> None:
    reporter, out = _reporter(terminal=False)
    with reporter:
        reporter.header(["model      1.00M parameters"])
        for step in (5, 10):
            reporter.progress(step=step, loss=2.5, lr=1e-3, tokens_per_s=1000.0, skips=0)
        reporter.ending({"steps": "10"}, ["next       make sample"])
    text = out.getvalue()
    steps = [ln for ln in text.splitlines() if ln.startswith("step ")]
    assert [ln.split("  ")[0] for ln in steps] == ["step 5/10", "step 10/10"]
    assert all(ln.split("  ")[1:5] == ["loss 2.5000", "lr 1.0e-03", "1k tok/s", "skips 0"]
               for ln in steps)  # fmt: skip
    assert "━" not in text and "\x1b" not in text
    assert text.index("run summary") > text.index("step 10/10")
    assert text.rstrip().endswith("next       make sample")


def test_on_a_terminal_the_bar_ends_before_the_summary() -> None:
    reporter, out = _reporter(terminal=True)
    with reporter:
        reporter.progress(step=10, loss=2.5, lr=1e-3, tokens_per_s=1000.0, skips=0)
        reporter.ending({"steps": "10"}, ["next       make sample"])
    text = out.getvalue()
    assert "step 10/10 ━" in text  # a bar, not a plain line
    assert text.rindex("━") < text.index("run summary")  # never redrawn after the end
    assert text.rstrip().endswith("next       make sample")


def test_no_progress_flag_prints_plain_lines_on_a_terminal_too() -> None:
    reporter, out = _reporter(terminal=True, live=False)
    with reporter:
        reporter.progress(step=10, loss=2.5, lr=1e-3, tokens_per_s=1000.0, skips=0)
    assert "step 10/10  loss 2.5000" in out.getvalue() and "━" not in out.getvalue()
