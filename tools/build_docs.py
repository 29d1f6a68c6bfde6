"""Build isotrain's HTML API reference with pdoc.

    .venv/bin/python tools/build_docs.py                  # -> docs/index.html
    .venv/bin/python tools/build_docs.py -o /tmp/api --no-source --with-train

Documents the package page (``isotrain.__all__``) and every public pattern module
(``isotrain.autograd``, ``isotrain.guard``, ...), each by its ``__all__``. The reference trainer
``isotrain.train`` is an application of the patterns, not library API: it is left out unless
``--with-train`` is given.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import warnings
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = ROOT / "docs"


def _import_isotrain() -> ModuleType:
    try:
        return importlib.import_module("isotrain")
    except ImportError:  # running from a source checkout without an install
        sys.path.insert(0, str(ROOT / "src"))
        return importlib.import_module("isotrain")


def public_modules(*, include_train: bool = False) -> list[str]:
    """``isotrain`` and its public submodules (no leading underscore), sorted."""
    pkg = _import_isotrain()
    names = [
        f"isotrain.{m.name}"
        for m in pkgutil.iter_modules(pkg.__path__)
        if not m.name.startswith("_") and (include_train or m.name != "train")
    ]
    return ["isotrain", *sorted(names)]


def public_api(*, include_train: bool = False) -> dict[str, list[str]]:
    """Each public module's ``__all__`` (dunder names such as ``__version__`` left out)."""
    api = {}
    for name in public_modules(include_train=include_train):
        module = importlib.import_module(name)
        exported = getattr(module, "__all__", None)
        if exported is None:
            raise ValueError(f"{name} has no __all__: list its public names so pdoc shows them")
        api[name] = [n for n in exported if not (n.startswith("__") and n.endswith("__"))]
    return api


def build(
    output: str | Path = DEFAULT_OUTPUT, *, show_source: bool = True, include_train: bool = False
) -> list[Path]:
    """Render the HTML reference into ``output``; returns the written HTML files."""
    import pdoc
    import pdoc.render

    output = Path(output)
    modules = public_modules(include_train=include_train)
    version = getattr(importlib.import_module("isotrain"), "__version__", "")
    pdoc.render.configure(
        docformat="restructuredtext",  # the docstrings' ``code`` and "Example::" blocks
        show_source=show_source,
        footer_text=f"isotrain {version}",
        search=True,
    )
    with warnings.catch_warnings():
        # pdoc warns about objects it cannot inspect (e.g. C-implemented torch members)
        warnings.simplefilter("ignore")
        pdoc.pdoc(*modules, output_directory=output)
    return sorted(output.rglob("*.html"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Build the isotrain API reference (HTML, pdoc).")
    p.add_argument("-o", "--output", type=Path, default=DEFAULT_OUTPUT, help="output folder")
    p.add_argument("--no-source", action="store_true", help="omit the 'view source' blocks")
    p.add_argument("--with-train", action="store_true", help="also document isotrain.train")
    args = p.parse_args(argv)
    files = build(args.output, show_source=not args.no_source, include_train=args.with_train)
    index = args.output / "index.html"
    print(f"wrote {len(files)} HTML files to {args.output} (open {index})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
