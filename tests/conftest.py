"""Shared pytest fixtures for the isotrain suite.

Isolation audit (autouse, every test): each test runs inside ``isotrain.contexts.rng_isolated``
and an ``isotrain.contexts.StateAudit`` of global state (no modules). A test FAILS (reported as an
error in teardown, with the list of leaks) if it leaves grad mode, inference mode, autocast
(enabled/dtype/cache, cpu and cuda), default dtype, deterministic-algorithms flags, thread count,
anomaly mode, float32 matmul precision or the compiler stance different from how it found them.
After reporting, the fixture puts the leaked state back so one leak does not cascade into every
later test.

The global RNGs (Python ``random``, torch CPU, CUDA if already initialised, numpy if imported)
are deliberately NOT audited: drawing from them (``torch.randn`` without a generator) or seeding
them (``torch.manual_seed``) is ordinary test code. Instead the fixture restores them after each
test, so every test starts from the same RNG state whatever ran before it, and tests stay
independent of order and of ``-k`` selection. To check that *library* code leaves the RNG
alone, audit it inside the test: ``with StateAudit(raise_on_leak=True): ...``.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest
import torch

from isotrain.autograd import CPU_KIND_ENV, CPU_KINDS
from isotrain.contexts import StateAudit, rng_isolated


def _share_the_cores() -> None:
    """Under pytest-xdist (`make test` runs one worker per core) each worker and the processes
    it starts get their share of the cores, so workers never oversubscribe them."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        share = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(share)
        torch.set_num_threads(share)


_share_the_cores()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Everything the test modules imported (torch, dynamo, transformers: about 400,000
    objects) goes to the garbage collector's permanent generation (`gc.freeze`), so each
    collection, and each `gc.get_referrers` the doctor runs to find the LR schedulers bound to
    an optimizer, scans only what the tests create: 0.1 s per scan becomes microseconds."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """`--precision auto` caches its probe: keep the suite's probes out of the user's home."""
    before = os.environ.get("ISOTRAIN_CACHE_DIR")
    os.environ["ISOTRAIN_CACHE_DIR"] = str(tmp_path_factory.mktemp("isotrain-cache"))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("ISOTRAIN_CACHE_DIR", None)
        else:
            os.environ["ISOTRAIN_CACHE_DIR"] = before


@pytest.fixture(autouse=True)
def _isolation_audit() -> Iterator[None]:
    # Cover CUDA only if a test already initialised it: never initialise CUDA just for this.
    cuda = range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []
    with rng_isolated(devices=cuda), StateAudit(check_rng=False, warn=False) as audit:
        yield
    if audit.differences:
        audit.restore()
        leaks = "\n".join(f"  - {d}" for d in audit.differences)
        pytest.fail(f"test leaked global state (restored now):\n{leaks}", pytrace=False)


@pytest.fixture(params=CPU_KINDS)
def cpu_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each CPU kind in turn, forced by ISOTRAIN_CPU_KIND: the test runs that kind's bf16 path
    on any machine (NOTE [forcing the CPU kind] in isotrain.autograd._cpu)."""
    monkeypatch.setenv(CPU_KIND_ENV, request.param)
    return request.param


@pytest.fixture
def own_cpu_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine's own CPU kind, even when the suite runs under ISOTRAIN_CPU_KIND."""
    monkeypatch.delenv(CPU_KIND_ENV, raising=False)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One torch thread for the test, restored after it. Tiny models do microseconds per op,
    and on a shared 2-core machine two OpenMP threads spin-wait for each other whenever a
    neighbour takes a core (steps measured 2 ms on one thread, 870 ms on two): one thread keeps
    the tests' time independent of the load."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
