"""The doctor across ranks: examine under a process group, the Monitor in a real loop.

ONE spawned gloo world of two CPU processes (~6 s to start) runs every check; the workers write
what they measured to JSON and each test below asserts on its part. Each bug of
tests/doctor/zoo_ranks.py is found with its kind and cause, and its correct twin gets no error
and no warning.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import io
import itertools
import json
import random
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tests.doctor import zoo, zoo_ranks
from tests.guides import DOCS, fenced, section
from tests.worlds import join_env, spawn_world

from isotrain.doctor import Monitor, examine
from isotrain.doctor.ranks import link as ranks_mod

WORLD = 2
ACROSS = ["replica_divergence", "gradient_not_synchronized", "same_data_on_ranks",
          "gradient_scaled_by_world", "collective_mismatch", "data_split_across_ranks"]  # fmt: skip
SEED_OF_FAULTS = 7  # random.Random(7): its first draw below 0.01 is the 107th


def _findings(d: Any) -> list[dict[str, str]]:
    return [f.__dict__ for f in d.findings]


def _fingerprint(setup: dict[str, Any]) -> str:
    """sha256 of every tensor the caller owns: parameters, grads, buffers, optimizer state."""
    h = hashlib.sha256()
    model, opt = setup["model"], setup["optimizer"]
    tensors = [*model.state_dict().values(), *(p.grad for p in model.parameters())]
    for state in opt.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t  # an FSDP2 shard: this rank's part
        h.update(b"none" if t is None else t.detach().reshape(-1).view(torch.uint8).numpy())
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    h.update(repr(groups).encode())
    return h.hexdigest()


def _cases() -> dict[str, Any]:
    out = []
    for kind, buggy, twin in zoo_ranks.CASES:
        bug = examine(**buggy(), checks=ACROSS, rank_timeout=30)
        clean = examine(**twin(), checks=ACROSS, rank_timeout=30)
        out.append({"kind": kind, "bug": _findings(bug), "twin": _findings(clean)})
    return {"cases": out}


def _correct_setup_under_all_checks() -> dict[str, Any]:
    """A correct DDP setup mid-training (grads and Adam state present) under checks="all"."""
    setup = zoo_ranks.setup()
    zoo_ranks.step(setup["model"], setup["optimizer"], setup["batches"][0])  # state to keep
    before, rng = _fingerprint(setup), torch.get_rng_state()
    d = examine(**setup, checks="all", task="classification", rank_timeout=30)
    return {
        "all_findings": _findings(d),
        "all_kinds": d.checks,
        "unchanged": before == _fingerprint(setup) and torch.equal(rng, torch.get_rng_state()),
    }


def _correct_fsdp2_setup() -> dict[str, Any]:
    """The same model sharded with FSDP2 (each Linear, then the root) mid-training."""
    from torch.distributed.fsdp import fully_shard

    model = zoo.seeded(zoo.MLP)
    for layer in (model.fc1, model.fc2):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    batches = list(itertools.islice(zoo_ranks.loader(), 2))
    setup = dict(model=model, optimizer=opt, batches=batches, step=zoo_ranks.step)
    zoo_ranks.step(model, opt, batches[0])
    before = _fingerprint(setup)
    d = examine(**setup, checks="fast", task="classification", rank_timeout=30)
    return {"fsdp_findings": _findings(d), "fsdp_kinds": d.checks,
            "fsdp_unchanged": before == _fingerprint(setup)}  # fmt: skip


def _silent_rank(rank: int) -> dict[str, Any]:
    """Rank 1 reaches the exchange after rank 0 gave up: rank 0's message names it."""
    ranks_mod.GRACE = 0.3
    link = ranks_mod.Ranks(timeout=0.5, label="test")
    if rank == 1:
        time.sleep(1.0)
    started = time.monotonic()
    try:
        link.gather("a test exchange")
        error = None
    except ranks_mod.RankError as e:
        error = str(e)
    waited = time.monotonic() - started
    link.close()
    dist.barrier()
    return {"silent_error": error, "silent_waited": waited}


def _faulty_hook(rank: int, calls: list[int]) -> Any:
    """DDP's all-reduce, with its result changed on rank 1 in 1% of calls (both ranks draw the
    same random numbers, so both know when)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    draw = random.Random(SEED_OF_FAULTS)

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads real annotations
        calls.append(int(draw.random() < 0.01))
        fut = default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]
        if rank != 1 or not calls[-1]:
            return fut

        def corrupt(f: Any) -> torch.Tensor:
            t = f.value()
            t[0] += 1e-3  # one entry of the averaged gradients is lost on this rank
            return t

        return fut.then(corrupt)

    return hook


def _monitored(rank: int, *, faulty: bool, steps: int = 200) -> dict[str, Any]:
    """A plain DDP loop with `monitor.after_step()`: the run stops at the first error."""
    model = zoo.seeded(zoo.MLP)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    calls: list[int] = []
    if faulty:
        ddp.register_comm_hook(None, _faulty_hook(rank, calls))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    found: list[Any] = []
    monitor = Monitor(ddp, opt, on_finding=found.append)
    try:
        for _ in range(steps):
            x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
            if any(f.severity == "error" for f in monitor.after_step()):
                break
    finally:
        monitor.close()
    first = calls.index(1) + 1 if 1 in calls else None
    return {"stopped_at": monitor.step, "found": [f.__dict__ for f in found], "first_fault": first}


def _across_ranks_blocks(lang: str) -> list[str]:
    """The ```lang blocks of the guide's page on ranks (docs/ranks.md)."""
    return fenced(section(DOCS / "ranks.md", "# Across ranks"), lang)


def _guide(out: Path) -> dict[str, Any]:
    """`isotrain doctor ddp_example.py --checks fast` on every rank, as torchrun runs it: what
    each rank prints and its exit status, for the guide's file and for its fix."""
    from isotrain.train.cli.main import main

    example, fixed = _across_ranks_blocks("python")[:2]
    res: dict[str, Any] = {}
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.chdir(out):
        for name, code in (("example", example), ("fixed", example + fixed)):
            Path(f"ddp_{name}.py").write_text(code)
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                res[f"{name}_status"] = main(["doctor", f"ddp_{name}.py", "--checks", "fast"])
            res[f"{name}_printed"] = printed.getvalue()
    return res


def _worker(rank: int, port: int, out: str) -> None:
    join_env(rank, WORLD, port)
    dist.init_process_group("gloo")
    try:
        res, times = {}, {}
        for name, part in (
            ("cases", _cases), ("all", _correct_setup_under_all_checks),
            ("fsdp", _correct_fsdp2_setup),
            ("silent", lambda: _silent_rank(rank)),
            ("guide", lambda: _guide(Path(out, f"guide{rank}"))),
            ("faulty", lambda: {"faulty": _monitored(rank, faulty=True)}),
            ("sound", lambda: {"sound": _monitored(rank, faulty=False)}),
        ):  # fmt: skip
            started = time.perf_counter()
            res.update(part())
            times[name] = round(time.perf_counter() - started, 2)
        res["seconds"] = times
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_world(_worker, tmp_path_factory.mktemp("ranks"), WORLD)


def _loud(found: list[dict[str, str]]) -> list[dict[str, str]]:
    return [f for f in found if f["severity"] in ("error", "warning")]


@pytest.mark.slow
def test_each_bug_is_found_and_its_twin_is_clean(world: list[dict[str, Any]]) -> None:
    for res in world:  # every rank returns the same merged diagnosis
        for case in res["cases"]:
            kinds = [(f["kind"], f["severity"]) for f in _loud(case["bug"])]
            assert kinds == [(case["kind"], "error")], case
            assert _loud(case["twin"]) == [], case
    assert world[0]["cases"] == world[1]["cases"]


@pytest.mark.slow
def test_each_finding_names_the_parameters_the_ranks_and_the_cause(world) -> None:
    cases = [c["bug"][0] for c in world[0]["cases"]]
    replaced, silent, moved, some_calls, clipped, data, buffers, bincount, alone, parts = cases
    assert "they were replaced after DDP(model) was built" in silent["evidence"]
    assert replaced["where"] == "fc1.weight, fc1.bias, fc2.weight (+1 more)"
    assert "(ranks 0 and 1 differ; max |difference| " in replaced["evidence"]
    assert "they were replaced after DDP(model) was built" in replaced["evidence"]
    assert "the model was converted in place after wrapping" in moved["evidence"]
    assert some_calls["evidence"].startswith("at optimizer.step() (step 2)")  # the second call
    assert "without its DDP wrapper (model.module(...))" in some_calls["evidence"]
    assert clipped["evidence"].startswith("after step 1, 4 of 4 replicated parameters differ")
    assert "equal after backward but differed at optimizer.step()" in clipped["evidence"]
    assert data["evidence"].startswith("ranks 0, 1 got byte-identical batches[0], batches[1]")
    assert buffers["where"] == "proj"  # BatchNorm's statistics differ by rank by design
    assert buffers["evidence"].startswith("after the steps, 1 of 1 unwritten buffers differ")
    assert "broadcast_buffers=False" in buffers["evidence"]
    lines, start = inspect.getsourcelines(zoo_ranks.counting)
    line = start + next(i for i, s in enumerate(lines) if "dist.all_reduce(counts)" in s)
    assert bincount["where"].endswith(f"zoo_ranks.py:{line}")
    assert (
        "rank 0: all_reduce(tensor (4,) int64); rank 1: all_reduce(tensor (3,) int64)"
        in (bincount["evidence"])
    )
    assert alone["evidence"].startswith("the ranks are at different points: rank 0 at all_reduce")
    assert "several backwards ran through one forward (retain_graph=True)" in parts["evidence"]
    assert "converted in place" not in parts["evidence"]


@pytest.mark.slow
def test_a_correct_ddp_setup_has_no_error_or_warning_and_stays_bitwise_unchanged(world) -> None:
    for res in world:
        assert _loud(res["all_findings"]) == [], res["all_findings"]
        assert res["unchanged"]
        assert set(ACROSS) <= set(res["all_kinds"])


@pytest.mark.slow
def test_a_correct_fsdp2_setup_has_no_error_or_warning_and_stays_bitwise_unchanged(world) -> None:
    for res in world:
        assert _loud(res["fsdp_findings"]) == [], res["fsdp_findings"]
        assert res["fsdp_unchanged"]
        assert set(ACROSS) <= set(res["fsdp_kinds"])


@pytest.mark.slow
def test_a_rank_that_does_not_answer_is_named_after_the_timeout(world) -> None:
    first, late = world
    assert first["silent_error"] == (
        "rank 1 did not answer within 0.5 s (at a test exchange): stuck in another collective, "
        "busy elsewhere, or gone; every rank must reach the same checks"
    )
    assert 0.5 <= first["silent_waited"] < 1.0  # the timeout and the grace, no more
    assert late["silent_error"] is not None  # the late rank finds the link broken, no hang


@pytest.mark.slow
def test_the_monitor_finds_a_corrupted_all_reduce_within_a_period(world) -> None:
    for res in world:
        faulty = res["faulty"]
        assert faulty["first_fault"] == 107
        assert faulty["stopped_at"] == 110  # the first check after the fault (every 10)
        (found,) = faulty["found"]
        assert found["kind"] == "replica_divergence" and found["severity"] == "error"
        assert found["evidence"].startswith("at step 110, ")
        assert "(ranks 0 and 1 differ; max |difference| " in found["evidence"]
        assert res["sound"] == {"stopped_at": 200, "found": [], "first_fault": None}


def _timing_free(text: str) -> str:
    return re.sub(r"in [0-9.]+ s\)", "in ... s)", text)


@pytest.mark.slow
def test_the_guide_s_table_is_what_rank_0_prints_under_torchrun(world) -> None:
    first, other = world
    (shown,) = [b for b in _across_ranks_blocks("text") if b.startswith("SEVERITY")]
    assert _timing_free(first["example_printed"]) == _timing_free(shown)
    assert other["example_printed"] == ""  # one table: rank 0's
    assert first["example_status"] == other["example_status"] == 1
    assert first["fixed_status"] == other["fixed_status"] == 0
    assert "0 error(s), 0 warning(s)" in first["fixed_printed"] and other["fixed_printed"] == ""
