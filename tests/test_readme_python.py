"""Every ```python block of README.md and of the guide (docs/) runs as written, each in a fresh
namespace.

A block that needs an optional package or a GPU says so on its first line, visibly:
`# needs: transformers` or `# needs: cuda`; it is skipped (with the reason) where that is
missing, and runs everywhere else. A block that goes on from the one before it on its page (the
same file, shown in two parts) says `# continues the block above` on its first line and runs
after it.
"""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch
from tests.guides import PAGES, blocks, name

NEEDS = re.compile(r"#\s*needs:\s*(.+)")
CONTINUES = "# continues the block above"


def python_blocks() -> list[tuple[str, str]]:
    """(id, code) of each ```python block of every page, with its page and section."""
    out = []
    for page in PAGES:
        previous = None
        for i, block in enumerate(b for b in blocks(page) if b.lang == "python"):
            code = block.code
            if code.splitlines()[0].strip() == CONTINUES:
                assert previous is not None, f"{name(page)}: nothing above to continue"
                code = previous + code
            out.append((f"{name(page)} {i + 1}: {block.section}", code))
            previous = code
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


def test_every_page_with_python_has_its_blocks_collected() -> None:
    pages = {where.split(" ", 1)[0] for where, _ in BLOCKS}
    assert "README.md" in pages and len(pages) >= 9  # a parsing slip would skip them all
    assert sum(where.startswith("README.md") for where, _ in BLOCKS) >= 6  # one per pattern


@pytest.mark.parametrize(("where", "code"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_python_block_runs_as_written(where: str, code: str) -> None:
    if missing := _missing(code):
        pytest.skip(f"block {where} needs {', '.join(missing)}")
    torch._dynamo.reset()  # compiled code of one block never serves another
    try:
        exec(compile(code, f"block {where}", "exec"), {"__name__": "__readme__"})
    finally:
        torch._dynamo.reset()
