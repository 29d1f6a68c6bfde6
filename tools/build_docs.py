"""Build isotrain's documentation site: the guides in docs/ and the API reference.

    .venv/bin/python tools/build_docs.py             # -> site/index.html (make docs)
    .venv/bin/python tools/build_docs.py -o /tmp/site

mkdocs with the material theme (mkdocs.yml); the API reference (docs/api/) is rendered by
mkdocstrings from the docstrings of the package page and of every public module, each by its
``__all__``. The reference trainer ``isotrain.train`` is an application of the patterns, not
library API: it has no page. The build is strict (a broken link or anchor, or a reference that
does not resolve, fails it) and offline: no web fonts, no script or style from elsewhere, and the
search works from the files on disk.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "mkdocs.yml"
DEFAULT_OUTPUT = ROOT / "site"


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
            raise ValueError(f"{name} has no __all__: list its public names so the docs show them")
        api[name] = [n for n in exported if not (n.startswith("__") and n.endswith("__"))]
    return api


def build(output: str | Path = DEFAULT_OUTPUT, **overrides: object) -> list[Path]:
    """Render the site into ``output``; returns its HTML files. ``overrides`` replace settings
    of mkdocs.yml (``docs_dir=...``); a warning aborts the build (strict)."""
    # Material prints a notice about its successor on import unless this is set: a build
    # with no warning must print none.
    os.environ.setdefault("NO_MKDOCS_2_WARNING", "1")
    from mkdocs.commands.build import build as mkdocs_build
    from mkdocs.config import load_config

    config = load_config(str(CONFIG), site_dir=str(output), strict=True, **overrides)
    mkdocs_build(config)
    return sorted(Path(output).rglob("*.html"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Build the isotrain documentation site (mkdocs).")
    p.add_argument("-o", "--output", type=Path, default=DEFAULT_OUTPUT, help="output folder")
    args = p.parse_args(argv)
    files = build(args.output)
    print(f"wrote {len(files)} HTML pages to {args.output} (open {args.output / 'index.html'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
