"""Every ```python block of README.md runs as written, each in a fresh namespace.

A block that needs an optional package or a GPU says so on its first line, visibly:
`# needs: transformers` or `# needs: cuda`; it is skipped (with the reason) where that is
missing, and runs everywhere else. A block that goes on from the one before it (the same file,
shown in two parts) says `# continues the block above` on its first line and runs after it.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
NEEDS = re.compile(r"#\s*needs:\s*(.+)")
CONTINUES = "# continues the block above"


def python_blocks() -> list[tuple[str, str]]:
    """(id, code) of each ```python block of the README, with the section it sits in."""
    out, section, block = [], "", None
    for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines():
        if block is None and line.startswith("#"):
            section = line.lstrip("#").strip()
        elif line.strip() == "```python":
            block = []
        elif line.strip() == "```" and block is not None:
            code = "\n".join(block) + "\n"
            if block and block[0].strip() == CONTINUES and out:
                code = out[-1][1] + code
            out.append((f"{len(out) + 1}: {section}", code))
            block = None
        elif block is not None:
            block.append(line)
    return out


BLOCKS = python_blocks()


def _missing(code: str) -> list[str]:
    first = NEEDS.match(code.splitlines()[0]) if code.strip() else None
    needs = [n.strip() for n in first.group(1).split(",")] if first else []
    return [
        n
        for n in needs
        if (n == "cuda" and not torch.cuda.is_available())
        or (n != "cuda" and importlib.util.find_spec(n) is None)
    ]


def test_the_readme_has_its_python_blocks() -> None:
    assert len(BLOCKS) >= 6  # one per pattern at least: a parsing slip would skip them all


@pytest.mark.parametrize(("where", "code"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_readme_python_block_runs_as_written(where: str, code: str) -> None:
    if missing := _missing(code):
        pytest.skip(f"README block {where} needs {', '.join(missing)}")
    torch._dynamo.reset()  # compiled code of one block never serves another
    try:
        exec(compile(code, f"README.md block {where}", "exec"), {"__name__": "__readme__"})
    finally:
        torch._dynamo.reset()
