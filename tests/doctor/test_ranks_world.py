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


def _case(kind: str, bug: Any, twin: Any) -> dict[str, Any]:
    """A bug and its twin examined, and whether the bug's objects were left as they were."""
    setup = bug()
    before = _fingerprint(setup)
    found = _found(setup)
    return {"kind": kind, "bug": found, "twin": _found(twin()),
            "kept": before == _fingerprint(setup)}  # fmt: skip


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
            group: [_case(*case) for case in cases]
            for group, cases in (("cases", zoo_world.CASES), ("held_out", zoo_world.HELD_OUT))
        }
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
            assert case["kept"], case
    assert world[0]["cases"] == world[1]["cases"]


@pytest.mark.slow
def test_a_correct_setup_under_all_checks_is_clean_and_left_as_it_was(world) -> None:
    for res in world:
        assert _loud(res["all"]) == [], res["all"]
        assert res["unchanged"] and res["generator_kept"]
        # set_epoch never called (AReaL#632): the state family's information, said once
        (epoch,) = [f for f in res["all"] if f["kind"] == "sampler_epoch"]
        assert (epoch["severity"], epoch["where"]) == ("info", "DistributedSampler")


def _evidence(world: list[dict[str, Any]], group: str = "cases") -> list[str]:
    return [
        next(f["evidence"] for f in c["bug"] if f["kind"] == c["kind"]) for c in world[0][group]
    ]


@pytest.mark.slow
def test_a_wrong_split_names_what_was_drawn_and_its_cause(world) -> None:
    seed, replicas, whole, epoch = _evidence(world)[:4]
    drawn = "over one epoch of your DataLoader's DistributedSampler (64 samples; 2 ranks drawing "
    assert seed.startswith(drawn + "32, 32), 20 of the draws repeat a sample another rank "
                           "drew and 20 samples no rank drew: ")  # fmt: skip
    assert "the sampler's seed differs by rank (0 on rank 0, 1 on rank 1)" in seed
    assert replicas.startswith(drawn + "16, 16), 32 samples no rank drew: ")
    assert "(rank 0: num_replicas=4, rank=0; rank 1: num_replicas=4, rank=1)" in replicas
    assert "64 of the draws repeat a sample" in whole
    assert whole.endswith("each rank's RandomSampler draws from the whole dataset (no "
                          "DistributedSampler)")  # fmt: skip
    assert "the sampler's epoch differs by rank (1 on rank 0, 0 on rank 1)" in epoch
    for case in world[0]["cases"][:4]:  # judged and clean: no "not checked" either
        assert [f for f in case["twin"] if f["kind"] == "data_split_across_ranks"] == []


@pytest.mark.slow
def test_a_world_scaled_gradient_names_the_factor_and_where_it_came_from(world) -> None:
    times, divided, summed, _ = _evidence(world)[4:8]
    head = "at optimizer.step() (step 1) the gradients are {} x the mean over 2 ranks"
    assert times.startswith(head.format(2)) and "backward ran on your returned loss x 2" in times
    assert times.endswith("Each step moves 2 x as far as one process would on the same batches")
    assert divided.startswith(head.format(0.5)) and "returned loss x 0.5" in divided
    assert "Adam-type optimizer normalises most of a constant scale away" in divided
    assert "between backward and optimizer.step() the gradients were scaled by 2 " in summed


@pytest.mark.slow
def test_held_out_long_live_seed_is_named(world) -> None:
    (found,) = [f for f in world[0]["held_out"][0]["bug"] if f["severity"] == "error"]
    assert found["kind"] == "data_split_across_ranks"
    assert "the sampler's seed differs by rank (0 on rank 0, " in found["evidence"]
    assert _loud(world[0]["held_out"][0]["twin"]) == []


@pytest.mark.slow
def test_several_backwards_are_judged_on_their_summed_gradient(world) -> None:
    accumulated, parts = _evidence(world)[8:]
    head = "at optimizer.step() (step 1) the gradients are {} x the mean over 2 ranks"
    assert accumulated.startswith(head.format(2))
    assert "your 4 backwards ran on 2 x the loss your step returned, in all" in accumulated
    assert (
        "each micro-batch's backward ran on its cross_entropy output x 0.5, so 4 of them add "
        "up to 2 x their mean (no_sync: accumulation); 2 = the world size 2."
    ) in accumulated
    assert accumulated.endswith("Each step moves 2 x as far as one process would on the same "
                                "batches")  # fmt: skip
    assert parts.startswith(head.format(0.5))
    assert ("each of the 2 parts of one forward's loss (cross_entropy/mse_loss) was backwarded "
            "x 0.5; 0.5 = 1 / the world size 2 or 1 / the 2 backwards.") in parts  # fmt: skip
    (fix,) = [f["fix"] for f in world[0]["cases"][9]["bug"] if f["severity"] == "warning"]
    assert fix.startswith("backward each part of the loss as it is")
    for case in world[0]["cases"][8:] + world[0]["held_out"][1:]:  # judged: no "not checked"
        assert [f for f in case["twin"] if f["kind"] == "gradient_scaled_by_world"] == []


@pytest.mark.slow
def test_held_out_automodel_dp_size_loss_is_named(world) -> None:
    case = world[0]["held_out"][1]
    assert _loud(case["twin"]) == []
    assert _loud(case["bug"]) == [("gradient_scaled_by_world", "warning")]
    assert case["kept"]
    (evidence,) = _evidence(world, "held_out")[1:]
    assert evidence.startswith(
        "at optimizer.step() (step 1) the gradients are 4 x the mean over "
        "2 ranks of each rank's gradient of the loss it returned"
    )
    assert "4 = the world size 2 x the 2 backwards" in evidence


# -- the judgements alone, on the numbers each rank would send (no world needed) -------------
def _summary(ratio: float | None, before: list[float], factor: float, gathers: int = 0) -> Any:
    from isotrain.doctor.ranks.backwards import Summary

    return Summary(before, [factor * v for v in before], gathers, returned=ratio)


@pytest.mark.parametrize(
    ("ratios", "path", "gathers", "factor"),
    [
        ((2.0, 2.0), 1.0, 0, 2.0),  # loss x world
        ((None, None), 0.5, 0, 0.5),  # the path halves: a divide on top of DDP's average
        ((2.0, 2.0), 0.5, 0, None),  # loss x world, path / world: one process's gradient
        ((2.0, 2.0), 1.0, 1, None),  # a loss over gathered outputs may scale on purpose
        ((2.0004, 1.9996), 1.0, 0, None),  # a logged sum over ranks, the losses near log C
        ((65536.0, 65536.0), 1 / 65536, 0, None),  # GradScaler: scaled, then unscaled
        ((None, None), 0.37, 0, None),  # clipping on every rank
    ],
)
def test_the_gradient_scale_is_judged_on_the_product_of_its_two_factors(
    ratios: tuple[float | None, float | None], path: float, gathers: int, factor: float | None
) -> None:
    from isotrain.doctor.ranks.scale import scale_finding

    before = [[0.3, -1.2, 0.8, 2.0], [0.5, -0.7, 1.1, 1.6]]  # two ranks' sums after backward
    summaries = [_summary(r, b, path, gathers) for r, b in zip(ratios, before, strict=True)]
    found = scale_finding(summaries, 2, adaptive=False)
    if factor is None:
        assert found == []
    else:
        (f,) = found
        assert (f.kind, f.severity, f.where) == ("gradient_scaled_by_world", "warning",
                                                 "optimizer.step()")  # fmt: skip
        assert f.evidence.startswith(f"at optimizer.step() (step 1) the gradients are {factor:g} x")


def _ranks_of(backwards: int, path: float, **fields: Any) -> list[Any]:
    """Two ranks' summaries of a step with several backwards (the same factors on both)."""
    from isotrain.doctor.ranks.backwards import Summary

    before = [[0.3, -1.2, 0.8, 2.0], [0.5, -0.7, 1.1, 1.6]]
    scales = fields.pop("scales", (None,) * backwards)
    return [Summary(b, [path * v for v in b], backwards=backwards, scales=scales, **fields)
            for b in before]  # fmt: skip


@pytest.mark.parametrize(
    ("backwards", "fields", "path", "said"),
    [
        # NVIDIA-NeMo/Automodel#3830: each micro-batch's mean loss x dp_size
        (2, dict(returned=4.0, scales=(2.0, 2.0)), 1.0, [("warning", 4)]),
        # correct: loss / 4 under no_sync; or returning the sum of the undivided losses
        (4, dict(returned=1.0, scales=(0.25,) * 4, unsynced=True), 1.0, []),
        (4, dict(returned=0.25, scales=(0.25,) * 4), 1.0, []),
        # loss / (world x 3): DDP averages again
        (3, dict(returned=0.5, scales=(1 / 6,) * 3), 1.0, [("warning", 0.5)]),
        # a GAN's real and fake terms, each backwarded whole: right as a sum
        (2, dict(scales=(1.0, 1.0)), 1.0, []),
        # the same under no_sync is accumulation: the micro-batches were not divided
        (2, dict(scales=(1.0, 1.0), unsynced=True), 1.0, [("warning", 2)]),
        # divided by the 4 micro-batches twice
        (4, dict(scales=(1 / 16,) * 4, unsynced=True), 1.0, [("warning", 0.25)]),
        # chunks of one output, each / 2, nothing returned: right as a mean
        (2, dict(scales=(0.5, 0.5), layout="parts"), 1.0, []),
        # parts of one loss each / world, their sum returned
        (2, dict(returned=0.5, scales=(0.5, 0.5), layout="parts"), 1.0, [("warning", 0.5)]),
        # the loss right, an all_reduce SUM of .grad on top of DDP (4 micro-batches: with 2, a
        # sum of two halves doubled reads right)
        (4, dict(returned=1.0, scales=(0.25,) * 4), 2.0, [("warning", 2)]),
        # a loss weight is not this bug; nor is a rank-dependent factor judged as one
        (2, dict(scales=(0.3, 0.3)), 1.0, []),
        # no reading of the loss: said, and the path judged alone
        (2, dict(scales=(0.5, 0.5), layout="mixed"), 1.0, [("info", None)]),
        (2, dict(), 2.0, [("info", None), ("warning", 2)]),
    ],
)
def test_several_backwards_are_read_every_way_that_can_hold(
    backwards: int, fields: dict[str, Any], path: float, said: list[tuple[str, float | None]]
) -> None:
    from isotrain.doctor.ranks.scale import scale_finding

    found = scale_finding(_ranks_of(backwards, path, **fields), 2, adaptive=False)
    assert [f.severity for f in found] == [severity for severity, _ in said]
    for f, (_, factor) in zip(found, said, strict=True):
        assert f.kind == "gradient_scaled_by_world"
        if factor is None:
            assert f.evidence.startswith("not checked: the loss's factor, since ")
        else:
            assert f.evidence.startswith(f"at optimizer.step() (step 1) the gradients are "
                                         f"{factor:g} x the mean over 2 ranks")  # fmt: skip


def test_ranks_that_ran_different_numbers_of_backwards_are_said_not_judged() -> None:
    from isotrain.doctor.ranks.scale import scale_finding

    two, three = _ranks_of(2, 1.0, returned=4.0), _ranks_of(3, 1.0, returned=4.0)
    (f,) = scale_finding([two[0], three[1]], 2, adaptive=False)
    assert (f.severity, f.where) == ("info", "optimizer.step()")
    assert "different numbers of backwards before optimizer.step() (2 on rank 0, 3 on rank 1)" in (
        f.evidence
    )


def test_each_backward_is_read_as_a_constant_times_a_loss_output() -> None:
    import torch.nn.functional as F
    from tests.doctor import zoo

    from isotrain.doctor.ranks.backwards import Backwards, summarize

    model, backs = zoo.seeded(zoo.MLP).eval(), Backwards()
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    weight = torch.ones((), requires_grad=True)
    ran = []
    with backs.watching(model):
        for i, (xs, ys) in enumerate(zip(x.chunk(4), y.chunk(4), strict=True)):
            out = model(xs)
            if i == 0:
                loss = F.cross_entropy(out, ys)
                loss /= 4  # in place: the output's node stays in the graph
            elif i == 1:
                loss = F.cross_entropy(out, ys, reduction="sum") / 2  # not a mean
            elif i == 2:
                loss = F.mse_loss(out, torch.zeros_like(out)) * weight  # a factor with a gradient
            else:
                loss = F.cross_entropy(out, ys).double() * 3
            loss.backward()
            backs.backward(loss, synced=i == 3)
            ran.append(loss.item())
        total = model(x).sum()  # no loss function
        total.backward()
        backs.backward(total, synced=True)
        backs.backward(model(x), synced=True)  # not a scalar, and after a forward of its own
    got = summarize(backs, sum(ran), [], [], 0)
    assert got.backwards == 6 and got.returned is None  # not every backward ran on a scalar
    assert got.scales[0] == pytest.approx(0.25, rel=1e-6) and got.scales[3] == pytest.approx(3)
    assert got.scales[1:3] == (None, None) and got.scales[4:] == (None, None)
    assert (got.losses, got.layout, got.unsynced) == (("cross_entropy",), "micro-batches", True)
    assert backs._seen == {} and not model._forward_pre_hooks  # nothing kept past the step
    shared = Backwards()
    shared.own, shared.ran_on, shared.scaled = [True, False], [torch.ones(())] * 2, [None] * 2
    assert summarize(shared, 1.0, [], [], 0).layout == "parts"
    shared.own = [True, False, True]
    assert summarize(shared, 1.0, [], [], 0).layout == "mixed"


@pytest.mark.parametrize(
    ("returned", "ratio"),
    [(0.75, 1.0), (0.5, None), (1.0, None), (torch.tensor(1.5), 0.5), ((0.75, "log"), 1.0)],
)
def test_the_returned_loss_is_a_reading_only_where_it_can_be_the_steps(
    returned: Any, ratio: float | None
) -> None:
    from isotrain.doctor.ranks.backwards import Backwards, summarize

    backs = Backwards()  # two micro-batches' losses 0.5 and 1.0 backwarded / 2
    backs.ran_on, backs.own = [torch.tensor(0.25), torch.tensor(0.5)], [True, True]
    backs.scaled = [(torch.tensor(0.5), "cross_entropy"), (torch.tensor(1.0), "cross_entropy")]
    got = summarize(backs, returned, [], [], 0)
    assert got.scales == (0.5, 0.5)
    assert got.returned == (None if ratio is None else pytest.approx(ratio))


def test_padding_and_drop_last_even_out_a_split_without_a_finding() -> None:
    from isotrain.doctor.ranks.shards import _Epoch, _judge

    def epoch(indices: list[int], n: int, rank: int) -> _Epoch:
        bits = torch.zeros(n + (-n) % 8, dtype=torch.uint8)
        bits[indices] = 1
        packed = (bits.view(-1, 8) << torch.arange(8, dtype=torch.uint8)).sum(1).to(torch.uint8)
        return _Epoch((n, "h"), "DistributedSampler", len(indices), False,
                      packed.numpy().tobytes(), (2, rank, 0, 0))  # fmt: skip

    padded = [epoch(list(range(0, 63, 2)), 63, 0), epoch([*range(1, 63, 2), 0], 63, 1)]
    assert _judge(padded, 2) == []  # 63 samples: rank 1 draws sample 0 again to even out
    dropped = [epoch(list(range(0, 62, 2)), 63, 0), epoch(list(range(1, 62, 2)), 63, 1)]
    assert _judge(dropped, 2) == []  # drop_last=True: sample 62 left out
    halves = [epoch(list(range(32)), 64, 0), epoch(list(range(16, 48)), 64, 1)]
    (f,) = _judge(halves, 2)
    assert "16 of the draws repeat a sample another rank drew and 16 samples no rank drew" in (
        f.evidence
    )
