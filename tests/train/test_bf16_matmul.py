"""`--precision bf16-matmul`: bf16 matmuls, attention in fp32, fp32 weights and optimizer state."""

import dataclasses
import shutil

import pytest
import torch
from tests.op_dtypes import OpDtypes

from isotrain.train import config as C
from isotrain.train.loop import setup, train
from isotrain.train.rundir.metrics import read_metrics
from isotrain.train.rundir.snapshot import load_snapshot
from isotrain.train.step import precision_context, train_step

MATMULS = {"mm", "addmm", "bmm", "baddbmm", "layout_mm"}  # layout_mm: Bf16Linear on AVX2 CPUs
LINEAR = {"avx2": {"layout_mm"}, "avx512-bf16": {"mm", "addmm"}, "amx": {"mm", "addmm"}}


def _cfg(out, **kw) -> C.TrainConfig:
    base = C.PRESETS["smoke"]()
    data = dataclasses.replace(base.data, max_bytes=60_000)
    return dataclasses.replace(base, data=data, out_dir=str(out), **kw)


def test_the_step_runs_matmuls_in_bf16_and_attention_in_fp32(tmp_path, cpu_kind) -> None:
    run = setup(_cfg(tmp_path, precision="bf16-matmul"))
    with OpDtypes() as seen:
        train_step(run)
    sdpa = [op for op in seen.ops if "scaled_dot_product" in op]
    assert any(op.endswith("_backward") for op in sdpa), sdpa
    # The kind's path: AVX2 multiplies in Bf16Linear's layout op, the others in ATen's.
    assert {op for op in seen.ops if op in MATMULS} == LINEAR[cpu_kind]
    assert seen.where(lambda op: op in MATMULS) == {torch.bfloat16}  # forward and backward
    assert seen.where(lambda op: "scaled_dot_product" in op) == {torch.float32}
    assert all(p.dtype == torch.float32 for p in run.model.parameters())  # master weights
    states = [t for s in run.optimizer.state.values() for t in s.values() if t.dim()]
    assert states and all(t.dtype == torch.float32 for t in states)  # AdamW moments
    with pytest.raises(ValueError, match="precision 'auto' has no autocast context"):
        precision_context("auto", torch.device("cpu"))


def test_fifty_steps_end_within_bf16_tolerance_of_fp32(tmp_path) -> None:
    losses = {}
    for precision in ("fp32", "bf16-matmul"):
        torch.manual_seed(0)
        run = setup(_cfg(tmp_path / precision, precision=precision, steps=50))
        outcomes = [train_step(run) for _ in range(50)]
        losses[precision] = [float(o.loss) for o in outcomes]
    fp32, mixed = losses["fp32"], losses["bf16-matmul"]
    assert mixed[-1] < 0.8 * mixed[0]  # it trains
    assert mixed != fp32  # bf16 did run: not the fp32 numbers
    assert mixed[-1] == pytest.approx(fp32[-1], rel=1e-2)  # bf16 rounding, not another run


def test_resume_in_bf16_matmul_is_bit_exact(tmp_path) -> None:
    kw = {
        "precision": "bf16-matmul",
        "model": dataclasses.replace(C.PRESETS["smoke"]().model, dropout=0.1),
        "snapshot": C.SnapshotConfig(every=3, keep=10),
        "steps": 7,
        "log_every": 1,
        "sample_tokens": 0,
    }
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(_cfg(straight, **kw))
    (resumed / "snapshots").mkdir(parents=True)
    shutil.copytree(straight / "snapshots" / "step_0000003", resumed / "snapshots" / "step_0000003")
    assert train(_cfg(resumed, **kw)).step == 7
    (a, _), (b, _) = load_snapshot(straight), load_snapshot(resumed)
    assert a["config"]["precision"] == b["config"]["precision"] == "bf16-matmul"
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for (k, sa), sb in zip(a["optimizer"]["state"].items(), b["optimizer"]["state"].values()):
        assert all(torch.equal(sa[n], sb[n]) for n in sa), k

    def loss(run):
        return {r["step"]: r["loss"] for r in read_metrics(run) if r["kind"] == "train"}

    la, lb = loss(straight), loss(resumed)
    assert {s: la[s] for s in lb} == lb and min(lb) == 4 and max(lb) == 7
