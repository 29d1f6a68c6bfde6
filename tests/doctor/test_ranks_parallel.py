"""The doctor across ranks on parallel code no framework wraps: manual data parallel, tensor
parallel, expert parallel (tests/doctor/zoo_parallel.py), in one spawned gloo world of two.

Each correct twin gets no error and no warning (the gradients judged are those
optimizer.step() receives; shards are not compared) and each bug is found with its kind.
"""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from tests.doctor import zoo_parallel
from tests.worlds import join_env, spawn_world

from isotrain.doctor import examine

WORLD = 2
# not data_split_across_ranks: these setups hand the doctor lists of batches, no DataLoader
ACROSS = ["replica_divergence", "gradient_not_synchronized", "same_data_on_ranks",
          "gradient_scaled_by_world", "collective_mismatch"]  # fmt: skip


def _found(setup: dict[str, Any]) -> list[dict[str, str]]:
    return [f.__dict__ for f in examine(**setup, checks=ACROSS, rank_timeout=30).findings]


def _worker(rank: int, port: int, out: str) -> None:
    join_env(rank, WORLD, port)
    dist.init_process_group("gloo")
    try:
        started = time.perf_counter()
        res = {
            name: {"kind": kind, "bug": _found(bug()), "twin": _found(twin())}
            for name, kind, bug, twin in zoo_parallel.CASES
        }
        res["seconds"] = time.perf_counter() - started  # type: ignore[assignment]
        res["fast"] = {  # type: ignore[assignment]
            name: [f.__dict__ for f in examine(**twin(), checks="fast", rank_timeout=30).findings]
            for name, _, _, twin in zoo_parallel.CASES
            if name in ("tensor_parallel", "expert_parallel_splits")
        }
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_world(_worker, tmp_path_factory.mktemp("parallel"), WORLD)


def _loud(found: list[dict[str, str]]) -> list[tuple[str, str]]:
    return [(f["kind"], f["severity"]) for f in found if f["severity"] in ("error", "warning")]


@pytest.mark.slow
def test_each_parallel_bug_is_found_and_its_correct_twin_is_clean(world) -> None:
    first, other = world
    assert first.pop("seconds") < 60 and other.pop("seconds") < 60
    assert first == other  # every rank returns the same merged diagnosis
    for name, case in first.items():
        if name == "fast":
            continue
        assert _loud(case["bug"]) == [(case["kind"], "error")], (name, case["bug"])
        assert _loud(case["twin"]) == [], (name, case["twin"])


@pytest.mark.slow
def test_a_manual_all_reduce_is_judged_where_optimizer_step_receives_the_gradients(world) -> None:
    cases = world[0]
    for name in ("manual_dp_forgotten", "manual_dp_before_backward"):
        (bug,) = cases[name]["bug"]
        assert bug["where"] == "fc1.weight, fc1.bias, fc2.weight (+1 more)"
        assert bug["evidence"].startswith(
            "at optimizer.step() (step 1), the gradients of 4 of 4 replicated parameters differ "
            "across ranks (ranks 0 and 1 differ; max |difference| "
        )
        assert bug["evidence"].endswith(
            "nothing averaged the gradients across ranks between the last backward and "
            "optimizer.step()"
        )
        assert cases[name]["twin"] == []  # no shard, no info either


@pytest.mark.slow
def test_shards_are_said_once_and_only_replicated_parameters_are_compared(world) -> None:
    tp, ep = world[0]["tensor_parallel"], world[0]["expert_parallel_router"]
    for case, shards, counts in (
        (tp, "w1, b1, w2", "3 of 4"),
        (ep, "expert.weight, expert.bias", "2 of 6"),
    ):
        (info,) = [f for f in case["twin"] if f["severity"] == "info"]
        assert (info["kind"], info["where"]) == ("replica_divergence", shards)
        assert info["evidence"].startswith(
            f"{counts} parameters differ across ranks before the first step and no DDP/FSDP "
            "wrapper holds the model: taken as shards (tensor or expert parallel), each rank's own"
        )
    bias = next(f for f in tp["bug"] if f["severity"] == "error")
    assert bias["where"] == "b2"  # the replicated bias, the only one compared
    assert "the gradients of 1 of 1 replicated parameters differ" in bias["evidence"]
    assert "a row-parallel layer's partial sums not all-reduced in forward" in bias["evidence"]
    router = next(f for f in ep["bug"] if f["severity"] == "error")
    assert router["where"] == "router.weight, router.bias, head.weight (+1 more)"


@pytest.mark.slow
def test_all_to_all_split_sizes_that_do_not_pair_are_named_before_the_call(world) -> None:
    (bug,) = [f for f in world[0]["expert_parallel_splits"]["bug"] if f["severity"] == "error"]
    lines, start = inspect.getsourcelines(zoo_parallel._AllToAll.forward)
    line = start + next(i for i, s in enumerate(lines) if "dist.all_to_all_single(" in s)
    assert bug["where"].endswith(f"zoo_parallel.py:{line}")  # the tokens' all_to_all_single
    assert (
        "rank 0: all_to_all_single(output (8, 8) float32; input (8, 8) float32; "
        "output_split_sizes=[4, 4]; input_split_sizes=[4, 4]); rank 1: all_to_all_single("
        "output (8, 8) float32; input (8, 8) float32; output_split_sizes=[2, 6]; "
        "input_split_sizes=[2, 6]); "
        "rank 0 sends rank 1 (4, 8), rank 1 expects (2, 8)" in bug["evidence"]
    )


@pytest.mark.slow
def test_every_fast_check_leaves_the_tensor_and_expert_parallel_twins_alone(
    world: list[dict[str, Any]],
) -> None:
    """Their routing syncs sit inside forward (information) and the doctor's own exchange
    between ranks is never counted as the user's host sync."""
    for rank in world:
        for name, found in rank["fast"].items():
            assert _loud(found) == [], (name, found)
