"""The doctor's pages are true: the README's example and the guide's print the tables shown, the
guide's fixed loop passes, and the guide's list of kinds is the API's."""

from __future__ import annotations

import contextlib
import io
import re
import runpy
from pathlib import Path

import pytest
from tests.guides import DOCS, ROOT, fenced, section

from isotrain.doctor import KINDS

README, GUIDE = ROOT / "README.md", DOCS / "doctor.md"


def _summary_free(text: str) -> list[str]:
    """The table without its timing (the last line's seconds)."""
    lines = text.rstrip("\n").splitlines()
    return [*lines[:-1], re.sub(r"in [0-9.]+ s\)", "in ... s)", lines[-1])]


def _run_as_file(code: str, where: Path) -> tuple[str, dict]:
    """What `python doctor_example.py` prints, run from `where`, and its namespace."""
    (where / "doctor_example.py").write_text(code)
    out = io.StringIO()
    with contextlib.chdir(where), contextlib.redirect_stdout(out):
        # the table names doctor_example.py:LINE relative to here
        namespace = runpy.run_path("doctor_example.py", run_name="__main__")
    return out.getvalue(), namespace


@pytest.mark.parametrize(("page", "heading"), [(README, "## The doctor"), (GUIDE, "# The doctor")])
def test_the_example_prints_the_table_shown(page: Path, heading: str, tmp_path: Path) -> None:
    text = section(page, heading)
    buggy = fenced(text, "python")[0]
    (shown,) = fenced(text, "text")
    printed, _ = _run_as_file(buggy, tmp_path)
    assert _summary_free(printed) == _summary_free(shown)


def test_the_guide_s_fixed_loop_passes(tmp_path: Path) -> None:
    buggy, fixed, *_ = fenced(section(GUIDE, "# The doctor"), "python")
    _, namespace = _run_as_file(buggy, tmp_path)
    exec(compile(fixed, "doctor_example_fixed.py", "exec"), namespace)


def test_the_guide_lists_every_kind_once_in_order() -> None:
    listed = re.findall(r"^- `(\w+)`: ", section(GUIDE, "# The doctor"), flags=re.M)
    assert listed == list(KINDS)
