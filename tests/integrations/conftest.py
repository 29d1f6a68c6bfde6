"""One torch thread per integration test (restored after it).

These models are tiny: each op is microseconds, and on a shared 2-core machine two OpenMP
threads spin-wait for each other whenever a neighbour takes a core (steps measured 2 ms on one
thread, 870 ms on two). One thread keeps the time of the tests independent of the load.
"""

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
