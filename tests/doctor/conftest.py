"""One torch thread per doctor test (restored after it): the zoo's models are tiny, and two
OpenMP threads on a shared 2-core machine spin-wait for each other (see tests/integration)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
