"""Every test here runs on one torch thread (`one_torch_thread` in tests/conftest.py says why)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Applies tests/conftest.py's `one_torch_thread` to this whole directory."""
