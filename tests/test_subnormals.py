"""flush_subnormals: subnormal CPU floats are zero inside the block, the flag is put back after
it, and torch's worker threads flush too when the block comes first (NOTE [subnormals])."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from isotrain.contexts import flush_subnormals, subnormals_flushed

TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32; below it: subnormal
SRC = Path(__file__).resolve().parents[1] / "src"


def _can_flush() -> bool:
    supported = torch.set_flush_denormal(True)
    torch.set_flush_denormal(False)
    return supported


pytestmark = pytest.mark.skipif(not _can_flush(), reason="this CPU cannot flush subnormals")


def test_flushed_inside_the_block_and_kept_after_it() -> None:
    x = torch.full((1000,), TINY / 4)  # stored as a subnormal: made before the block
    assert not subnormals_flushed() and bool((x * 1).ne(0).all())
    with flush_subnormals() as flushed:
        assert flushed and subnormals_flushed()
        assert bool((x * 1).eq(0).all())  # subnormal inputs read as zero
        assert bool((torch.full((8,), TINY) / 4).eq(0).all())  # subnormal results become zero
    assert not subnormals_flushed() and bool((x * 1).ne(0).all())


def test_the_flag_comes_back_after_an_exception_and_when_nested() -> None:
    with pytest.raises(RuntimeError, match="boom"), flush_subnormals():
        raise RuntimeError("boom")
    assert not subnormals_flushed()
    with flush_subnormals():
        with flush_subnormals(enabled=False) as flushed:
            assert not flushed and not subnormals_flushed()
        assert subnormals_flushed()
    assert not subnormals_flushed()


def test_the_flag_reads_right_under_another_default_dtype_and_device() -> None:
    with flush_subnormals(), torch.device("meta"):
        torch.set_default_dtype(torch.float64)  # tiny / 2 is a normal float64
        try:
            assert subnormals_flushed()
        finally:
            torch.set_default_dtype(torch.float32)
    with torch.device("meta"):
        assert not subnormals_flushed()


CHILD = """
import numpy as np, torch
torch.set_num_threads(2)
from isotrain.contexts import flush_subnormals
a = torch.from_numpy(np.full((512, 512), np.finfo(np.float32).tiny / 4, dtype=np.float32))
with flush_subnormals({flush}):  # before torch's first parallel op: its workers inherit it
    print(int((a @ torch.ones(512, 512)).count_nonzero()))
"""


@pytest.mark.parametrize(("flush", "nonzero"), [(True, 0), (False, 512 * 512)])
def test_worker_threads_flush_when_the_block_comes_first(flush: bool, nonzero: int) -> None:
    """A two-thread matmul of subnormal inputs: every thread reads them as zero, or none."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "2"}
    code = CHILD.format(flush=flush)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.strip()) == nonzero
