"""Distributed training: torchrun environment, DDP / FSDP2 gradients, guard agreement, snapshots.

Fast tests run in-process (a gloo world of one where a process group is needed). The slow ones
share ONE spawned gloo world of two CPU processes (~6 s to start): the workers run every check
and write what they measured to JSON; each test below asserts on its part.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tests.guides import DOCS, fenced, section
from tests.worlds import ENV, free_port, join_env
from torch import nn

from isotrain.checkpointing import apply_activation_checkpointing
from isotrain.compile import compile_model
from isotrain.guard import StepGuard
from isotrain.train import config as C
from isotrain.train.data import batches as data_mod
from isotrain.train.model.gpt import GPT, GPTConfig
from isotrain.train.parallel import (
    DistInfo,
    any_rank,
    full_value,
    init_distributed,
    no_grad_sync,
    process_group_scope,
    wrap_model,
)
from isotrain.train.rundir.sharded import (
    check_layout,
    load_full_model,
    load_sharded,
    rank_rng_state,
    save_sharded,
)
from isotrain.train.rundir.snapshot import SnapshotError, load_snapshot

WORLD = 2


def _smoke(**kw) -> C.TrainConfig:
    base = C.PRESETS["smoke"]()
    return dataclasses.replace(base, data=dataclasses.replace(base.data, max_bytes=60_000), **kw)


def _model(seed: int = 0) -> GPT:
    m = _smoke().model
    cfg = GPTConfig(n_layer=m.n_layer, n_head=m.n_head, d_model=m.d_model, block_size=32)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return GPT(cfg)


def _batch(corpus, micro: int, rank: int, world: int = WORLD):
    return data_mod.get_batch(
        corpus.train, batch_size=4, block_size=32, seed=0, step=0, micro=micro, rank=rank,
        world_size=world,
    )  # fmt: skip


def _corpus():
    return data_mod.load_corpus(None, max_bytes=60_000, val_fraction=0.1)


def _max_rel_diff(model: nn.Module, ref: nn.Module) -> float:
    """Largest |g - g_ref| / max|g_ref| over parameters (DTensor grads gathered first)."""
    worst = 0.0
    for p, q in zip(model.parameters(), ref.parameters()):
        g = full_value(p.grad)
        worst = max(worst, float((g - q.grad).abs().max() / q.grad.abs().max()))
    return worst


# ------------------------------------------------------------------ in-process: environment
@pytest.fixture
def clean_env(monkeypatch):
    for v in ENV:
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def test_half_set_environment_is_refused(clean_env) -> None:
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setenv("RANK", "0")
    with pytest.raises(
        C.ConfigError,
        match=r"half set: RANK, WORLD_SIZE present but LOCAL_RANK, MASTER_ADDR, MASTER_PORT "
        r"missing; launch with torchrun, or unset them all",
    ):
        init_distributed("ddp", "cpu")
    assert not dist.is_initialized()


def test_parallel_mode_needs_torchrun_and_torchrun_needs_a_mode(clean_env) -> None:
    several = r"--parallel.mode fsdp needs several processes: isotrain train --nproc-per-node 2 "
    with pytest.raises(C.ConfigError, match=several):
        init_distributed("fsdp", "cpu")
    assert init_distributed("none", "cpu") == DistInfo(0, 1, 0, torch.device("cpu"))
    for v, value in zip(ENV, ("1", "2", "1", "127.0.0.1", "29500")):
        clean_env.setenv(v, value)
    with pytest.raises(C.ConfigError, match="started 2 processes but --parallel.mode is none"):
        init_distributed("none", "cpu")
    clean_env.setenv("RANK", "one")
    with pytest.raises(C.ConfigError, match="not an integer"):
        init_distributed("ddp", "cpu")
    assert not dist.is_initialized()


def _world_of_one(monkeypatch) -> None:
    for v, value in zip(ENV, ("0", "1", "0", "127.0.0.1", str(free_port()))):
        monkeypatch.setenv(v, value)


def test_scope_destroys_only_the_group_it_saw_created(clean_env) -> None:
    _world_of_one(clean_env)
    with process_group_scope():
        info = init_distributed("ddp", "cpu")
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        assert (info.rank, info.world_size, info.is_main, info.distributed) == (0, 1, True, False)
        with process_group_scope():  # an inner scope leaves the outer group alone
            init_distributed("ddp", "cpu")
        assert dist.is_initialized()
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="boom"), process_group_scope():
        init_distributed("fsdp", "cpu")
        raise RuntimeError("boom")
    assert not dist.is_initialized()


def test_batches_are_disjoint_across_ranks_and_a_pure_function_of_their_index() -> None:
    import numpy as np

    tokens = np.arange(10_000, dtype=np.int64)  # token value == its position
    shard = len(tokens) // WORLD

    def draw(step, micro, rank):
        x, y = data_mod.get_batch(
            tokens, batch_size=4, block_size=32, seed=3, step=step, micro=micro, rank=rank,
            world_size=WORLD,
        )  # fmt: skip
        return torch.cat([x, y[:, -1:]], 1)  # every position the batch reads

    seen = {0: set(), 1: set()}
    for step in range(5):
        for micro in range(2):
            for rank in range(WORLD):
                b = draw(step, micro, rank)
                assert torch.equal(b, draw(step, micro, rank))  # pure: same index, same batch
                assert rank * shard <= int(b.min()) and int(b.max()) < (rank + 1) * shard
                seen[rank].update(b.flatten().tolist())
    assert not seen[0] & seen[1]
    assert not torch.equal(draw(0, 0, 0), draw(0, 1, 0))  # micro-steps draw other windows


# -------------------------------------------- in-process: FSDP2 and DCP in a gloo world of one
def test_fsdp_altered_blocks_and_sharded_snapshot_in_a_world_of_one(clean_env, tmp_path) -> None:
    """Checkpointed + compiled blocks shard; a DCP snapshot restores model and optimizer."""
    _world_of_one(clean_env)
    corpus, info = _corpus(), DistInfo(0, 1, 0, torch.device("cpu"))
    x, y = _batch(corpus, 0, 0, world=1)
    try:
        with process_group_scope():
            init_distributed("fsdp", "cpu")
            ref, model = _model(), _model()
            apply_activation_checkpointing(model, policy="full")  # the trainer's order
            compile_model(model, backend="eager", fallback=False)
            assert all(block._compiled_call_impl is not None for block in model.blocks)
            wrap_model(model, "fsdp", info)
            ref(x, y).backward()
            model(x, y).backward()
            assert _max_rel_diff(model, ref) < 1e-5  # order may differ: see NOTE in the worker
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
            opt.step()
            snap = save_sharded(tmp_path, model, opt, {"world_size": 1}, step=1)
            assert (tmp_path / "snapshots" / "LATEST").read_text() == "step_0000001"
            fresh = _model(seed=1)
            wrap_model(fresh, "fsdp", info)
            fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2, fused=True)
            load_sharded(snap, fresh, fresh_opt)
            for p, q in zip(model.parameters(), fresh.parameters()):
                assert torch.equal(p.full_tensor(), q.full_tensor())
                for k in ("exp_avg", "exp_avg_sq", "step"):
                    a, b = opt.state[p][k], fresh_opt.state[q][k]
                    assert torch.equal(full_value(a), full_value(b))
            plain = load_full_model(snap, _model(seed=2))
            for (n, p), q in zip(model.named_parameters(), plain.parameters()):
                assert torch.equal(p.full_tensor(), q), n
            newer = save_sharded(tmp_path, model, opt, {"world_size": 1}, step=2)
    finally:
        torch._dynamo.reset()
    (newer / "shards" / "__0_0.distcp").write_bytes(b"truncated")
    with pytest.raises(SnapshotError, match=r"__0_0.distcp is damaged: its checksum does not"):
        load_full_model(newer, _model())
    assert load_snapshot(tmp_path, check=None)[1] == snap  # a damaged shard: the older one


def test_resume_layout_refusals_name_both_world_sizes() -> None:
    p = Path("run/snapshots/step_0000004")
    old_new = r"written by 4 FSDP ranks but this run has 2\..*Relaunch with 4 processes in total"
    with pytest.raises(C.ConfigError, match=old_new + r" \(torchrun --nproc-per-node 4 on one"):
        check_layout({"sharded": True, "world_size": 4}, p, mode="fsdp", world_size=2)
    with pytest.raises(C.ConfigError, match=r"FSDP shards from 2 ranks but --parallel.mode is ddp"):
        check_layout({"sharded": True, "world_size": 2}, p, mode="ddp", world_size=2)
    with pytest.raises(C.ConfigError, match=r"single-copy snapshot .* --parallel.mode is fsdp"):
        check_layout({"world_size": 2}, p, mode="fsdp", world_size=2)
    check_layout({"world_size": 2}, p, mode="ddp", world_size=3)  # DDP: allowed, with a warning
    check_layout({"sharded": True, "world_size": 2}, p, mode="fsdp", world_size=2)
    payload = {"rng": "zero", "rng_per_rank": ["zero", "one"]}
    assert [rank_rng_state(payload, r) for r in range(3)] == ["zero", "one", "zero"]
    assert rank_rng_state({"rng": "only"}, 1) == "only"


# ------------------------------------------------------------------ the spawned world of two
# NOTE [gradient tolerance]: DDP sums each rank's mean gradient over 4 sequences and divides by
# 2; one process takes the mean over 8 at once. Same math, other float32 summation order: the
# results may differ in the last bits (relative ~1e-7 per addition), so we allow 1e-5 of the
# largest gradient entry. A wrong averaging (sum instead of mean, a missed rank) is off by 2x.
GRAD_TOL = 1e-5


def _check_grads(info: DistInfo, corpus, mode: str) -> dict:
    """Two micro-batches, the first without gradient sync; compare to one process."""
    ref, model = _model(), _model()
    if mode == "fsdp":  # compile is covered in the world of one (it costs seconds per process)
        apply_activation_checkpointing(model, policy="full")
    wrapped = wrap_model(model, mode, info)
    local = None
    for micro in range(2):
        x, y = _batch(corpus, micro, info.rank)
        with no_grad_sync(wrapped, sync=micro == 1):
            (wrapped(x, y) / 2).backward()
        if micro == 0 and mode == "ddp":
            local = {n: p.grad.clone() for n, p in model.named_parameters()}
    for micro in range(2):  # the global batch: every rank's micro-batch, concatenated
        xs, ys = zip(*(_batch(corpus, micro, r) for r in range(WORLD)))
        (ref(torch.cat(xs), torch.cat(ys)) / 2).backward()
    out = {f"{mode}_grad_rel_diff": _max_rel_diff(model, ref)}
    if local is not None:  # under no_sync the grads are this rank's own, not yet averaged
        own = _model()
        x, y = _batch(corpus, 0, info.rank)
        (own(x, y) / 2).backward()
        out["ddp_no_sync_kept_local"] = all(
            torch.equal(local[n], p.grad) for n, p in own.named_parameters()
        )
    return out


def _same_on_all_ranks(params) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    got = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(got, flat)
    return all(torch.equal(got[0], g) for g in got)


def _check_guard(info: DistInfo) -> dict:
    """NaN in rank 1's loss only (grads finite): both ranks skip; then both apply."""
    out = {}
    for mode in ("host", "select"):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            lin = nn.Linear(4, 2)
        ddp = nn.parallel.DistributedDataParallel(lin)
        opt = torch.optim.AdamW(lin.parameters(), lr=0.1, fused=mode == "host")
        guard = StepGuard(opt, lin, max_norm=1.0, spike_k=None, skip_mode=mode)
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(info.rank))
        applied, unchanged, same, losses = [], [], [], []
        for step in range(2):
            loss = ddp(x).square().mean()
            loss.backward()
            nan = float("nan") if (info.rank == 1 and step == 0) else 0.0
            before = [p.detach().clone() for p in lin.parameters()]
            local = float(loss)
            outcome = guard.step(loss.detach() + nan)
            applied.append(bool(outcome.applied))
            losses.append([local, float(outcome.loss)])
            unchanged.append(all(torch.equal(a, b) for a, b in zip(before, lin.parameters())))
            same.append(_same_on_all_ranks(lin.parameters()))
        out[f"guard_{mode}"] = {"applied": applied, "unchanged": unchanged, "same": same}
        out[f"guard_{mode}_losses"] = losses  # [this rank's loss, the loss the guard logs]
    return out


def _check_rng_per_rank(info: DistInfo, out_dir: Path) -> dict:
    """DDP save_run stores every rank's RNG state; resume gives each rank its own back."""
    from isotrain.train.loop import setup
    from isotrain.train.rundir.resume import maybe_resume, save_run

    cfg = _smoke(parallel=C.ParallelConfig(mode="ddp"), out_dir=str(out_dir / "rng"))
    run = setup(cfg)
    torch.manual_seed(100 + info.rank)  # ranks with different streams (e.g. per-rank dropout)
    save_run(run)
    expected = torch.rand(4)
    torch.manual_seed(7)
    resumed = maybe_resume(run, required=True)
    return {"rng_resumed": resumed, "rng_restored": torch.equal(torch.rand(4), expected)}


def _fsdp_cfg(out: Path) -> C.TrainConfig:
    cfg = _smoke(
        parallel=C.ParallelConfig(mode="fsdp"),
        snapshot=C.SnapshotConfig(every=3, keep=10),
        steps=6,
        eval_every=3,
        log_every=1,
        sample_tokens=4,
        out_dir=str(out),
    )
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dropout=0.1))


def _check_fsdp_resume(info: DistInfo, out_dir: Path) -> dict:
    """The trainer's own train(): 6 steps straight == 3 steps, snapshot, resume for 3."""
    from isotrain.train.loop import train

    straight, resumed = out_dir / "straight", out_dir / "resumed"
    st = train(_fsdp_cfg(straight))
    if info.is_main:
        shutil.copytree(
            straight / "snapshots" / "step_0000003", resumed / "snapshots" / "step_0000003"
        )
    dist.barrier()
    st2 = train(_fsdp_cfg(resumed))
    return {"fsdp_steps": [st.step, st2.step], **_check_planted_metadata(info, out_dir)}


class _Evil:
    """Unpickling this creates `marker`: proof that code from a snapshot ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def _check_planted_metadata(info: DistInfo, out_dir: Path) -> dict:
    """A code-running `.metadata` in the newest snapshot (checksum recomputed): both ranks fall
    back to the older snapshot, nothing runs, and the run ends where the straight one did."""
    import pickle

    from isotrain.train.loop import train
    from isotrain.train.rundir.integrity import sha256

    planted, marker = out_dir / "planted", out_dir / "pwned"
    if info.is_main:
        for name in ("step_0000003", "step_0000006"):
            shutil.copytree(out_dir / "straight" / "snapshots" / name, planted / "snapshots" / name)
        snap = planted / "snapshots" / "step_0000006"
        (snap / "shards" / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
        meta = json.loads((snap / "meta.json").read_text())
        meta["files"]["shards/.metadata"] = sha256(snap / "shards" / ".metadata")
        (snap / "meta.json").write_text(json.dumps(meta))
    dist.barrier()
    st = train(_fsdp_cfg(planted))
    return {"planted_steps": st.step, "planted_ran_code": marker.exists()}


def _check_lock_agreement(out_dir: Path) -> dict:
    """The parent test process holds `locked`'s lock: rank 0 is refused, rank 1 learns it."""
    from isotrain.train.loop import train

    try:
        train(_smoke(parallel=C.ParallelConfig(mode="ddp"), out_dir=str(out_dir / "locked")))
    except C.ConfigError as e:
        return {"lock_error": str(e)}
    return {"lock_error": None}


def _check_ddp_compile(info: DistInfo, out_dir: Path) -> dict:
    """The trainer under DDP with checkpointing and per-block compile, no recompiles allowed."""
    from isotrain.train.loop import train
    from isotrain.train.rundir.metrics import read_metrics

    cfg = _smoke(
        parallel=C.ParallelConfig(mode="ddp"),
        checkpointing=C.CheckpointingConfig(policy="full"),
        compile=C.CompileConfig(enabled=True, backend="eager", fail_on_recompile=True),
        steps=3, eval_every=2, log_every=1, sample_tokens=0, out_dir=str(out_dir / "ddp_compile"),
    )  # fmt: skip
    st = train(cfg)
    out = {"ddp_compile_steps": st.step}
    if info.is_main:
        train_records = [r for r in read_metrics(cfg.out_dir) if r["kind"] == "train"]
        out["ddp_compiles_after_warmup"] = train_records[-1]["compiles_after_warmup"]
    return out


def _doctor_cfg(out: Path, every: int, **kw) -> C.TrainConfig:
    return _smoke(
        parallel=C.ParallelConfig(mode="ddp"), doctor=C.DoctorConfig(every=every),
        snapshot=C.SnapshotConfig(every=4), steps=8, eval_every=100, log_every=1,
        sample_tokens=0, out_dir=str(out), **kw,
    )  # fmt: skip


def _check_doctor(info: DistInfo, out_dir: Path) -> dict:
    """The trainer's doctor under torchrun: it changes nothing in a sound run; an update that
    differs on rank 1 at step 6 stops the run at the check of step 8, with step 4's snapshot
    the newest; the same batches on every rank stop it before the first step."""
    from isotrain.train import loop
    from isotrain.train.rundir.snapshot import find_snapshots
    from isotrain.train.watch import Diverged

    out: dict = {}
    for every in (0, 2):
        st = loop.train(_doctor_cfg(out_dir / f"doctor{every}", every))
        out[f"doctor{every}_steps"] = st.step
    real = loop.build_optimizer

    def faulty(model, cfg):  # rank 1's update at step 6 is not rank 0's
        opt = real(model, cfg)

        def drift(*_):  # AdamW's own count: the doctor's trial steps are undone with its state
            weight = model.lm_head.weight
            if info.rank == 1 and int(opt.state[weight]["step"]) == 6:
                with torch.no_grad():
                    weight[0, 0] += 1e-3

        opt.register_step_post_hook(drift)
        return opt

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "build_optimizer", faulty)
        try:
            loop.train(_doctor_cfg(out_dir / "drift", 4))
        except Diverged as e:
            out["drift_error"] = str(e)
        drawn = loop.Batches.from_config  # BUG below: every rank draws rank 0's batches

        def rank_0s(cls, cfg, corpus, dist_info):
            return drawn(cfg, corpus, dataclasses.replace(dist_info, rank=0))

        mp.setattr(loop.Batches, "from_config", classmethod(rank_0s))
        try:
            loop.train(_doctor_cfg(out_dir / "same", 4))
        except Diverged as e:
            out["same_error"] = str(e)
    out["drift_snapshots"] = [p.name for p in find_snapshots(out_dir / "drift")]
    return out


def _worker(rank: int, port: int, out: str) -> None:
    join_env(rank, WORLD, port)
    res: dict = {}
    with process_group_scope():
        info = init_distributed("ddp", "cpu")
        corpus = _corpus()
        res.update(_check_grads(info, corpus, "ddp"))
        res.update(_check_grads(info, corpus, "fsdp"))
        res.update(_check_guard(info))
        res.update(_check_rng_per_rank(info, Path(out)))
        res.update(_check_fsdp_resume(info, Path(out)))
        res.update(_check_lock_agreement(Path(out)))
        res.update(_check_ddp_compile(info, Path(out)))
        res.update(_check_doctor(info, Path(out)))
        res["any_rank"] = [any_rank(info.rank == 1, info.device), any_rank(False, info.device)]
        res["world"] = dist.get_world_size()
    res["destroyed"] = not dist.is_initialized()
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> tuple[list[dict], Path]:
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("world")
    (out / "locked").mkdir()
    lock = os.open(out / "locked" / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)  # this process is "another isotrain" training there
    os.write(lock, f"{os.getpid()}\n".encode())
    try:
        with pytest.MonkeyPatch.context() as mpatch:
            mpatch.setenv("OMP_NUM_THREADS", "1")
            for v in ENV:
                mpatch.delenv(v, raising=False)
            mp.spawn(_worker, args=(free_port(), str(out)), nprocs=WORLD, join=True)
    finally:
        os.close(lock)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)], out


@pytest.mark.slow
def test_the_world_agrees_on_flags_and_its_group_is_destroyed(world) -> None:
    for res in world[0]:
        assert res["world"] == WORLD and res["destroyed"]
        assert res["any_rank"] == [True, False]  # a flag on rank 1 only reaches rank 0 too


@pytest.mark.slow
def test_ddp_and_fsdp_gradients_equal_one_process_on_the_global_batch(world) -> None:
    for res in world[0]:
        assert res["ddp_grad_rel_diff"] < GRAD_TOL, res["ddp_grad_rel_diff"]
        assert res["fsdp_grad_rel_diff"] < GRAD_TOL, res["fsdp_grad_rel_diff"]
        assert res["ddp_no_sync_kept_local"]


@pytest.mark.slow
def test_ddp_composes_with_checkpointing_and_compile(world) -> None:
    results, _ = world
    assert [r["ddp_compile_steps"] for r in results] == [3, 3]
    assert results[0]["ddp_compiles_after_warmup"] == 0


@pytest.mark.slow
def test_nan_on_one_rank_skips_the_step_on_every_rank(world) -> None:
    for res in world[0]:
        for mode in ("host", "select"):
            assert res[f"guard_{mode}"] == {
                "applied": [False, True],
                "unchanged": [True, False],
                "same": [True, True],
            }, (mode, res[f"guard_{mode}"])
    # the logged loss is the mean over ranks: NaN at the first step, then the same everywhere
    for mode in ("host", "select"):
        (a0, g0), (a1, g1) = (r[f"guard_{mode}_losses"][1] for r in world[0])
        assert g0 == g1 and g0 == pytest.approx((a0 + a1) / 2, rel=1e-6) and a0 != a1
        assert all(math.isnan(r[f"guard_{mode}_losses"][0][1]) for r in world[0])


@pytest.mark.slow
def test_ddp_snapshot_restores_each_ranks_own_rng(world) -> None:
    for res in world[0]:
        assert res["rng_resumed"] and res["rng_restored"]
    from isotrain.train.rundir.snapshot import load_snapshot

    payload, _ = load_snapshot(world[1] / "rng")
    a, b = payload["rng_per_rank"]
    assert payload["world_size"] == 2 and not torch.equal(a["torch"], b["torch"])


@pytest.mark.slow
def test_fsdp_resume_equals_the_uninterrupted_run(world) -> None:
    from isotrain.train.rundir.metrics import read_metrics

    for res in world[0]:
        assert res["fsdp_steps"] == [6, 6]
    straight, resumed = world[1] / "straight", world[1] / "resumed"
    snaps = [d / "snapshots" / "step_0000006" for d in (straight, resumed)]
    a, b = (load_full_model(s, _model(seed=i)) for i, s in enumerate(snaps))
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name
    for f in (snaps[0] / "shards").glob("*.distcp"):  # optimizer state too, byte for byte
        assert f.read_bytes() == (snaps[1] / "shards" / f.name).read_bytes(), f.name
    meta = json.loads((snaps[0] / "meta.json").read_text())
    assert meta["world_size"] == 2 and sorted(meta["files"]) == [
        "shards/.metadata",
        "shards/__0_0.distcp",
        "shards/__1_0.distcp",
        "state.pt",
    ]  # every file, checksummed

    def losses(run):
        return {r["step"]: r["loss"] for r in read_metrics(run) if r["kind"] == "train"}

    la, lb = losses(straight), losses(resumed)
    assert sorted(lb) == [4, 5, 6] and {s: la[s] for s in lb} == lb


@pytest.mark.slow
def test_torchrun_resume_never_runs_a_planted_pickle_and_falls_back(world) -> None:
    results, out = world
    assert [r["planted_steps"] for r in results] == [6, 6]
    assert not any(r["planted_ran_code"] for r in results) and not (out / "pwned").exists()
    snaps = [d / "snapshots" / "step_0000006" for d in (out / "straight", out / "planted")]
    for f in (snaps[0] / "shards").glob("*.distcp"):  # steps 4-6 trained again, identically
        assert f.read_bytes() == (snaps[1] / "shards" / f.name).read_bytes(), f.name


@pytest.mark.slow
def test_under_torchrun_rank_0_locks_and_every_rank_stops(world) -> None:
    results, out = world
    assert results[0]["lock_error"] == (
        f"{out / 'locked'} is in use by another isotrain process (PID {os.getpid()}); wait for "
        "it to finish, or try another --out-dir"
    )
    assert results[1]["lock_error"] == f"rank 0 could not lock {out / 'locked'}; see its error"
    assert sorted(p.name for p in (out / "locked").iterdir()) == [".lock"]  # nothing written


def _drift_line(snapshot: str) -> str:
    """The line a run stops with when its replicas diverge at step 8 (lm_head.weight is tied to
    wte.weight: one tensor, named by its first name), as a pattern."""
    return (
        r"replica_divergence at step 8: wte\.weight \(ranks 0 and 1 differ; max \|difference\| "
        r"0\.00\d+ in wte\.weight\); stopped without saving it, the newest snapshot, "
        + re.escape(snapshot)
        + r", is the last consistent step: fix the cause, then resume from it"
    )


def test_the_guide_shows_the_line_a_diverged_run_stops_with() -> None:
    (shown,) = fenced(section(DOCS / "ranks.md", "## The Monitor"), "text")
    prefix, _, line = shown.strip().partition("error: ")
    assert prefix == "isotrain train: "
    assert re.fullmatch(_drift_line("runs/ddp/snapshots/step_0000004"), line)


@pytest.mark.slow
def test_the_doctor_changes_nothing_and_stops_a_diverged_run_at_its_check(world) -> None:
    results, out = world
    for res in results:
        assert res["doctor0_steps"] == res["doctor2_steps"] == 8
        assert res["drift_snapshots"] == ["step_0000004"]  # nothing saved after the drift
        snap = out / "drift" / "snapshots" / "step_0000004"
        assert re.fullmatch(_drift_line(str(snap)), res["drift_error"]), res["drift_error"]
        assert res["same_error"].startswith("same_data_on_ranks before step 1: batches: ranks 0, 1")
    (a, pa), (b, pb) = (load_snapshot(out / f"doctor{every}") for every in (0, 2))
    assert pa.name == pb.name == "step_0000008"
    for name, p in a["model"].items():
        assert torch.equal(p, b["model"][name]), name  # the doctor left the run as it was
    for i, state in a["optimizer"]["state"].items():
        for k, v in state.items():
            assert torch.equal(v, b["optimizer"]["state"][i][k]), (i, k)
