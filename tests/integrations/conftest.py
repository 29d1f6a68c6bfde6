"""Every test here runs on one torch thread (`one_torch_thread` in tests/conftest.py says why);
`missing_extra` imports an integration as if its framework were not installed."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Applies tests/conftest.py's `one_torch_thread` to this whole directory."""


@pytest.fixture
def missing_extra(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str], str]:
    """`(integration, framework)` -> the ImportError's message when importing
    isotrain.integrations.INTEGRATION finds FRAMEWORK uninstalled (in this process)."""

    def message(integration: str, framework: str) -> str:
        monkeypatch.setitem(sys.modules, framework, None)  # what an import finds uninstalled
        monkeypatch.delitem(sys.modules, f"isotrain.integrations.{integration}", raising=False)
        with pytest.raises(ImportError) as caught:
            importlib.import_module(f"isotrain.integrations.{integration}")
        return str(caught.value)

    return message
