"""The public API is documented: every name has a docstring with an example; the site
(tools/build_docs.py, `make docs`) builds strict and offline and shows every name; every link of
the README resolves; and the figures of the README and the guide come from committed results."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from tests import guides

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
EXAMPLE_MARKERS = ("Example", ">>>", "::")

# Public names that still lack an example in their docstring, owned by other modules' authors.
# Names that are aliases, documented by what they alias: the seed defines
# `quantize = StraightThroughEstimator.apply`, whose docstring is torch's.
ALIASES: dict[str, str] = {
    "isotrain.autograd.quantize": "isotrain.autograd.StraightThroughEstimator"
}


def load_build_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_isotrain_build_docs", TOOLS / "build_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def public_objects() -> dict[str, Any]:
    """'module.name' -> object for every exported name, re-exports collapsed to one entry."""
    api = load_build_docs().public_api()
    seen: dict[int, str] = {}
    out: dict[str, Any] = {}
    # Submodules first: a name re-exported from `isotrain` is keyed by the module defining it.
    for module_name in sorted(api, key=lambda m: (m == "isotrain", m)):
        module = importlib.import_module(module_name)
        for name in api[module_name]:
            obj = getattr(module, name)
            home = getattr(obj, "__module__", None)
            key = f"{home}.{name}" if isinstance(home, str) and home in api else None
            key = key or f"{module_name}.{name}"
            if id(obj) not in seen:
                seen[id(obj)] = key
                out[key] = obj
    return out


def doc_problem(obj: Any, *, package: str = "isotrain") -> str | None:
    """Why ``obj``'s own docstring is missing or has no example, else None."""
    if not (inspect.isclass(obj) or callable(obj)):
        return None  # a constant: documented where it is defined, nothing to inspect
    home = getattr(obj, "__module__", None) or ""
    if not home.startswith(package):
        return f"its docstring comes from {home}: wrap it in a def or class of its own"
    doc = obj.__doc__ or ""  # not inspect.getdoc: a class must not borrow its base's text
    if dataclasses.is_dataclass(obj) and doc.startswith(f"{obj.__name__}("):
        doc = ""  # the signature dataclasses writes when there is no docstring
    if not doc.strip():
        return "no docstring"
    if not any(marker in doc for marker in EXAMPLE_MARKERS):
        return "no example (an 'Example' section, a '>>>' line or a '::' code block)"
    return None


def test_every_public_module_lists_its_names() -> None:
    api = load_build_docs().public_api()
    pattern_modules = {"autograd", "checkpointing", "guard", "compile", "contexts"}
    assert {f"isotrain.{m}" for m in pattern_modules} <= set(api)
    assert not any(m.startswith("isotrain.train") for m in api)  # the trainer is not library API
    for module_name, names in api.items():
        module = importlib.import_module(module_name)
        missing = [n for n in names if not hasattr(module, n)]
        assert not missing, f"{module_name}.__all__ lists undefined names {missing}"


def test_public_names_have_a_docstring_with_an_example() -> None:
    objects = public_objects()
    problems = {
        k: p for k, obj in objects.items() if (p := doc_problem(objects.get(ALIASES.get(k), obj)))
    }
    lines = "\n".join(f"  {k}: {p}" for k, p in sorted(problems.items()))
    assert not problems, f"public names without a documented example:\n{lines}"


def test_doc_problem_catches_each_kind() -> None:
    def documented() -> None:
        """Do it.

        Example: ``documented()``.
        """

    def bare() -> None:
        pass

    @dataclasses.dataclass
    class Plain:
        x: int

    here = documented.__module__
    assert doc_problem(documented, package=here) is None
    assert doc_problem(bare, package=here) == "no docstring"
    assert doc_problem(Plain, package=here) == "no docstring"
    assert (doc_problem(documented) or "").startswith(f"its docstring comes from {here}")
    assert doc_problem(importlib.import_module("isotrain.guard").StepGuard) is None
    assert "comes from torch" in (doc_problem(importlib.import_module("torch").nn.Linear) or "")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as `make docs` builds it (strict: a warning fails the build)."""
    out = tmp_path_factory.mktemp("site")
    assert load_build_docs().main(["-o", str(out)]) == 0
    return out


def test_the_site_shows_every_public_name(site: Path) -> None:
    assert (site / "index.html").is_file() and (site / "search" / "search_index.js").is_file()
    api_pages = {p.stem for p in (site / "api").glob("*.html")}
    assert "train" not in api_pages  # the trainer is not library API
    html = "".join(p.read_text(encoding="utf-8") for p in (site / "api").glob("*.html"))
    objects = public_objects()
    missing = [k for k in objects if f'id="{k}"' not in html]
    assert len(objects) > 50 and not missing, f"names absent from the API reference: {missing}"


def test_the_site_loads_nothing_from_elsewhere(site: Path) -> None:
    """Offline: every script, style sheet, font and image a page loads is in the site."""
    loads = re.compile(r"<(?:script|link|img|iframe)\b[^>]*?\b(?:src|href)=\"([^\"]+)\"")
    outside = set()
    for page in site.rglob("*.html"):
        outside |= {u for u in loads.findall(page.read_text(encoding="utf-8")) if "//" in u}
    assert outside == set()
    css = "".join(p.read_text(encoding="utf-8") for p in site.rglob("*.css"))
    assert "fonts.googleapis" not in css and "@import url(http" not in css


def test_a_broken_link_or_anchor_fails_the_build(tmp_path: Path) -> None:
    from mkdocs.exceptions import Abort

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n## Here\n\n[fine](#here) [gone](other.md#there)\n")
    (docs / "other.md").write_text("# Other\n")
    build = load_build_docs().build
    pages = ["index.md", "other.md"]
    with pytest.raises(Abort, match="1 warnings"):
        build(tmp_path / "site", docs_dir=str(docs), nav=pages, plugins=["search"])
    (docs / "other.md").write_text("# Other\n\n## There\n")
    assert len(build(tmp_path / "site", docs_dir=str(docs), nav=pages, plugins=["search"])) >= 2


def test_the_layout_names_every_package_and_module() -> None:
    """The guide's layout block (docs/layout.md) and the source tree agree, in both directions."""
    (block,) = [b.code for b in guides.blocks(guides.DOCS / "layout.md") if b.lang == ""]
    src = ROOT / "src" / "isotrain"
    named = set(re.findall(r"src/isotrain/([\w/.]+)", block))
    for entry in named:
        assert (src / entry).exists(), f"docs/layout.md names src/isotrain/{entry}: missing"
    tops = {p.name + ("/" if p.is_dir() else "") for p in src.iterdir() if p.name != "__pycache__"}
    tops -= {"py.typed", "__main__.py"}
    assert tops <= named, f"not in docs/layout.md: {sorted(tops - named)}"
    train = {p.name for p in (src / "train").glob("*.py") if p.name != "__init__.py"}
    assert all(name in block for name in train), sorted(n for n in train if n not in block)


def test_figures_come_from_committed_results() -> None:
    """Every interval the README and the guide quote is printed verbatim in a committed results
    file, and every benchmark script and results path they name exists: no number without its
    source."""
    text = "".join(page.read_text(encoding="utf-8") for page in guides.PAGES)
    results = ROOT / "benchmarks" / "results"
    printed = "".join(p.read_text(encoding="utf-8") for p in results.glob("*/*.md"))
    intervals = re.findall(r"\[-?\d+(?:\.\d+)?, -?\d+(?:\.\d+)?\]", text)
    assert len(intervals) >= 20, "the guide's benchmark tables lost their intervals"
    assert [i for i in intervals if i not in printed] == []
    paths = set(re.findall(r"benchmarks/(?:results/[\w./-]*\w|[\w]+\.py)", text))
    assert [p for p in sorted(paths) if not (ROOT / p).exists()] == []


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(page: Path) -> str:
    """A page's text without its fenced blocks (code may hold brackets that are no links)."""
    text, out, in_code = page.read_text(encoding="utf-8"), [], False
    for line in text.splitlines():
        in_code ^= line.startswith("```")
        if not in_code and not line.startswith("```"):
            out.append(line)
    return "\n".join(out)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to
    hyphens, a repeated one numbered."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+ (.+)$", _prose(page), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def test_every_link_of_the_readme_resolves() -> None:
    """Into the repository only (a test can resolve those offline), to a file or folder that
    exists, and to a heading of it that exists."""
    readme = ROOT / "README.md"
    links = LINK.findall(_prose(readme))
    assert len(links) >= 15
    broken = []
    for target in links:
        path, _, anchor = target.partition("#")
        dest = (readme.parent / path).resolve() if path else readme
        inside = dest.exists() and (dest == ROOT or ROOT in dest.parents)
        if "://" in target or not inside or (anchor and anchor not in anchors(dest)):
            broken.append(target)
    assert broken == []


def test_anchors_are_read_as_github_writes_them(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# Across ranks\n```\n# not a heading\n```\n## 1. `x`: y, z\n## Across ranks\n")
    assert anchors(page) == {"across-ranks", "1-x-y-z", "across-ranks-1"}


def test_the_readme_is_a_front_page_into_every_guide() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 300
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in LINK.findall(readme)}
    assert [guides.name(p) for p in guides.PAGES[1:] if p.resolve() not in linked] == []


# The blocks that are neither code nor commands, and the test that reads each.
CHECKED_ELSEWHERE = {
    ("README.md", "text", "The doctor"): "tests/doctor/test_doctor_readme.py",
    ("docs/doctor.md", "text", "The doctor"): "tests/doctor/test_doctor_readme.py",
    ("docs/ranks.md", "text", "Across ranks"): "tests/doctor/test_ranks.py",
    ("docs/ranks.md", "text", "The Monitor"): "tests/train/test_distributed.py",
    ("docs/layout.md", "", "Layout"): "tests/test_layout.py",
}


def test_every_block_of_every_page_is_one_the_suite_checks() -> None:
    """python blocks run (test_readme_python.py), bash blocks run (train/test_readme.py), and
    every other block is read by a test of its own: a new kind of block needs one."""
    unchecked = []
    for page in guides.PAGES:
        for block in guides.blocks(page):
            where = (guides.name(page), block.lang)
            claimed = [k for k in CHECKED_ELSEWHERE if k[:2] == where]
            if block.lang not in ("python", "bash") and not any(
                block.section.startswith(k[2]) for k in claimed
            ):
                unchecked.append((*where, block.section))
    assert unchecked == []
    assert all((ROOT / test).is_file() for test in CHECKED_ELSEWHERE.values())
