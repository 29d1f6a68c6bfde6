"""The documentation the tests walk: README.md, then every guide page in the site's order.

The pages are README.md and the Markdown files of docs/ that mkdocs.yml's `nav` lists, in that
order (a reader's order: the commands of a later page may use what an earlier one made). The
API reference pages (docs/api/) hold no code of their own and are left out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _nav_files(nav: object) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [f for v in nav.values() for f in _nav_files(v)]
    if isinstance(nav, list):
        return [f for v in nav for f in _nav_files(v)]
    return []


def guide_pages() -> list[Path]:
    """The guide's pages, in the order of mkdocs.yml's nav, the API reference left out."""
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]
    return [DOCS / f for f in _nav_files(nav) if not f.startswith("api/")]


PAGES = [ROOT / "README.md", *guide_pages()]


def name(page: Path) -> str:
    """A page's path from the repository root, as the tests name it."""
    return page.relative_to(ROOT).as_posix()


@dataclass(frozen=True)
class Block:
    page: Path
    section: str  # the heading it sits under, without its #s
    lang: str  # what follows the opening ```
    code: str


def blocks(page: Path) -> list[Block]:
    """Every fenced block of a page, in order."""
    out, section, lang, lines = [], "", None, []
    for line in page.read_text(encoding="utf-8").splitlines():
        if lang is None and line.startswith("```"):
            lang, lines = line[3:].strip(), []
        elif lang is not None and line.strip() == "```":
            out.append(Block(page, section, lang, "\n".join(lines) + "\n"))
            lang = None
        elif lang is not None:
            lines.append(line)
        elif line.startswith("#"):
            section = line.lstrip("#").strip()
    return out


def section(page: Path, heading: str) -> str:
    """The text under the first heading that starts with `heading` (`## The doctor`), up to the
    next heading of the same or a higher level."""
    level = len(heading.split(" ", 1)[0])
    out: list[str] | None = None
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines(keepends=True):
        in_code ^= line.startswith("```")
        heading_here = not in_code and re.match(r"#+ ", line)
        if out is None and heading_here and line.startswith(heading):
            out = []
        elif out is not None:
            if heading_here and len(line.split(" ", 1)[0]) <= level:
                break
            out.append(line)
    assert out is not None, f"{name(page)} has no heading {heading!r}"
    return "".join(out)


def fenced(text: str, lang: str) -> list[str]:
    """The code of each ```lang block in `text`."""
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)
