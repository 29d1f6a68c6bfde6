"""The README's doctor section is true: its loop prints the table shown, its fixed loop passes,
and its list of kinds is the API's."""

from __future__ import annotations

import contextlib
import io
import re
import runpy
from pathlib import Path

import pytest

from isotrain.doctor import KINDS

README = Path(__file__).resolve().parents[2] / "README.md"


def _section() -> str:
    text = README.read_text()
    return text.split("## The doctor", 1)[1].split("\n## ", 1)[0]


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", _section(), flags=re.S)


def _summary_free(text: str) -> list[str]:
    """The table without its timing (the last line's seconds)."""
    lines = text.rstrip("\n").splitlines()
    return [*lines[:-1], re.sub(r"in [0-9.]+ s\)", "in ... s)", lines[-1])]


def test_the_example_prints_the_table_shown_and_the_fixed_loop_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    buggy, fixed, *_ = _blocks("python")
    (shown,) = _blocks("text")
    (tmp_path / "doctor_example.py").write_text(buggy)
    monkeypatch.chdir(tmp_path)  # the table names doctor_example.py:LINE relative to here
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        namespace = runpy.run_path("doctor_example.py", run_name="__main__")
    assert _summary_free(out.getvalue()) == _summary_free(shown)
    exec(compile(fixed, "doctor_example_fixed.py", "exec"), namespace)


def test_the_readme_lists_every_kind_once_in_order() -> None:
    listed = re.findall(r"^- `(\w+)`: ", _section(), flags=re.M)
    assert listed == list(KINDS)
