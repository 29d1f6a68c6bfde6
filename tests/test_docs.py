"""The public API is documented: every name has a docstring with an example, and the pdoc
HTML reference (tools/build_docs.py, `make docs`) builds and shows every name."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import re
from pathlib import Path
from types import ModuleType
from typing import Any

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


def test_build_docs_writes_every_public_name(tmp_path: Path, capsys) -> None:
    build_docs = load_build_docs()
    out = tmp_path / "api"
    assert build_docs.main(["-o", str(out)]) == 0
    assert "HTML files" in capsys.readouterr().out
    assert (out / "index.html").is_file()
    assert not (out / "isotrain" / "train").exists()
    missing = []
    for module_name, names in build_docs.public_api().items():
        page = out.joinpath(*module_name.split(".")).with_suffix(".html")
        assert page.is_file(), f"pdoc wrote no page for {module_name}"
        html = page.read_text(encoding="utf-8")
        missing += [f"{module_name}.{n}" for n in names if f'id="{n}"' not in html]
    assert not missing, f"names absent from the HTML reference: {missing}"
    assert "view-source" in (out / "isotrain" / "guard.html").read_text(encoding="utf-8")


def test_readme_layout_names_every_package_and_module() -> None:
    """The README's layout block and the source tree agree, in both directions."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Layout", 1)[1].split("```", 2)[1]
    src = ROOT / "src" / "isotrain"
    named = set(re.findall(r"src/isotrain/([\w/.]+)", block))
    for entry in named:
        assert (src / entry).exists(), f"README layout names src/isotrain/{entry}: missing"
    tops = {p.name + ("/" if p.is_dir() else "") for p in src.iterdir() if p.name != "__pycache__"}
    tops -= {"py.typed", "__main__.py"}
    assert tops <= named, f"not in the README layout: {sorted(tops - named)}"
    train = {p.name for p in (src / "train").glob("*.py") if p.name != "__init__.py"}
    assert all(name in block for name in train), sorted(n for n in train if n not in block)


def test_readme_figures_come_from_committed_results() -> None:
    """Every interval the README quotes is printed verbatim in a committed results file, and
    every benchmark script and results path it names exists: no number without its source."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    results = ROOT / "benchmarks" / "results"
    printed = "".join(p.read_text(encoding="utf-8") for p in results.glob("*/*.md"))
    intervals = re.findall(r"\[-?\d+(?:\.\d+)?, -?\d+(?:\.\d+)?\]", readme)
    assert len(intervals) >= 20, "the README's benchmark tables lost their intervals"
    assert [i for i in intervals if i not in printed] == []
    paths = set(re.findall(r"benchmarks/(?:results/[\w./-]*\w|[\w]+\.py)", readme))
    assert [p for p in sorted(paths) if not (ROOT / p).exists()] == []
