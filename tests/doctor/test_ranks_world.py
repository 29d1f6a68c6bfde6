"""The doctor across ranks where the replicas stay equal: the data split between ranks and the
applied gradient's scale (tests/doctor/zoo_world.py), in one spawned gloo world of two.

Each bug is found with its kind, cause and measured numbers; each correct twin gets no error
and no warning; the caller's model, optimizer and sampler (its generator too) are left as
they were; the held-out reports are run once, as recorded in tests/doctor/ranks_reports.md.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from tests.doctor import zoo_world
from tests.doctor.test_ranks import _fingerprint
from tests.worlds import join_env, spawn_world

from isotrain.doctor import examine

WORLD = 2
KINDS = ["replica_divergence", "gradient_not_synchronized", "same_data_on_ranks",
         "gradient_scaled_by_world", "collective_mismatch", "data_split_across_ranks"]  # fmt: skip


def _found(setup: dict[str, Any]) -> list[dict[str, str]]:
    return [f.__dict__ for f in examine(**setup, checks=KINDS, rank_timeout=30).findings]


def _untouched() -> dict[str, Any]:
    """A correct setup under checks="all" (the state family's sampler_epoch beside the data
    split), and a RandomSampler's generator, each left as it was."""
    setup = zoo_world.split()
    before = (_fingerprint(setup), dict(vars(setup["batches"].sampler)))
    d = examine(**setup, checks="all", task="classification", rank_timeout=30)
    unchanged = before == (_fingerprint(setup), dict(vars(setup["batches"].sampler)))
    g = torch.Generator().manual_seed(5)
    drawn = zoo_world.split(lambda data: torch.utils.data.RandomSampler(data, generator=g))
    state = g.get_state()
    examine(**drawn, checks=["data_split_across_ranks"], rank_timeout=30)
    return {"all": [f.__dict__ for f in d.findings], "unchanged": unchanged,
            "generator_kept": torch.equal(g.get_state(), state)}  # fmt: skip


def _worker(rank: int, port: int, out: str) -> None:
    join_env(rank, WORLD, port)
    dist.init_process_group("gloo")
    try:
        started = time.perf_counter()
        res: dict[str, Any] = {
            group: [{"kind": k, "bug": _found(bug()), "twin": _found(twin())}
                    for k, bug, twin in cases]
            for group, cases in (("cases", zoo_world.CASES), ("held_out", zoo_world.HELD_OUT))
        }  # fmt: skip
        res.update(_untouched())
        res["seconds"] = round(time.perf_counter() - started, 2)
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_world(_worker, tmp_path_factory.mktemp("world"), WORLD)


def _loud(found: list[dict[str, str]]) -> list[tuple[str, str]]:
    return [(f["kind"], f["severity"]) for f in found if f["severity"] in ("error", "warning")]


@pytest.mark.slow
def test_each_bug_is_found_and_its_twin_is_clean(world: list[dict[str, Any]]) -> None:
    severity = {"data_split_across_ranks": "error", "gradient_scaled_by_world": "warning"}
    for res in world:
        for case in res["cases"]:
            assert _loud(case["bug"]) == [(case["kind"], severity[case["kind"]])], case
            assert _loud(case["twin"]) == [], case
    assert world[0]["cases"] == world[1]["cases"]


@pytest.mark.slow
def test_a_correct_setup_under_all_checks_is_clean_and_left_as_it_was(world) -> None:
    for res in world:
        assert _loud(res["all"]) == [], res["all"]
        assert res["unchanged"] and res["generator_kept"]
