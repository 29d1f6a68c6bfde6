"""Rollback in the trainer: it restores what a resume loaded, and logging never changes training."""

import dataclasses
import shutil

import torch

from isotrain.train import config as C
from isotrain.train.loop import setup, start, train
from isotrain.train.rundir.snapshot import load_snapshot
from isotrain.train.step import train_step


def _cfg(out, **kw) -> C.TrainConfig:
    base = C.PRESETS["smoke"]()
    guard = dict(rollback_after=2, rollback_check_every=1, rollback_copy_every=1)
    guard.update(kw.pop("guard", {}))
    return dataclasses.replace(
        base,
        data=dataclasses.replace(base.data, max_bytes=60_000),
        guard=C.GuardConfig(**guard),
        **{"steps": 6, "eval_every": 100, "sample_tokens": 0, "out_dir": str(out), **kw},
    )


def _state(run) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in run.model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_rollback_after_resume_restores_the_resumed_weights(tmp_path) -> None:
    train(_cfg(tmp_path, steps=4))
    fresh = _state(setup(_cfg(tmp_path / "fresh")))
    # Steps 5 and 6 (as logged) are NaN: two consecutive skips trigger a rollback after step 6.
    run = start(_cfg(tmp_path, steps=8, guard={"inject_nan_at": (5, 6)}))
    resumed = _state(run)
    opt_before = {k: v.clone() for k, v in run.optimizer.state_dict()["state"][0].items()}
    assert run.state.step == 4 and not _same(resumed, fresh)
    train_step(run)
    assert run.updater.last_action is None  # one skip: below the patience of 2
    train_step(run)
    assert run.updater.last_action.restored_step == 4
    assert _same(_state(run), resumed)  # the weights it resumed with, not the fresh init
    opt_after = run.optimizer.state_dict()["state"][0]
    assert all(torch.equal(opt_before[k], opt_after[k]) for k in opt_before)


def test_rollback_cadence_is_its_own_setting(tmp_path) -> None:
    run = setup(_cfg(tmp_path, guard={"inject_nan_at": (2, 3, 4), "rollback_check_every": 4}))
    for _ in range(3):
        train_step(run)
    assert run.updater.last_action is None  # three skips, but no check until step 4
    train_step(run)
    assert run.updater.last_action is not None and run.updater.last_action.step == 4


def test_log_every_changes_no_loss_across_a_resume(tmp_path) -> None:
    kw = {"steps": 12, "guard": {"inject_nan_at": (9, 10)}, "snapshot": C.SnapshotConfig(every=6)}
    train(_cfg(tmp_path / "straight", log_every=2, **kw))  # rolls back after step 10
    snap = "snapshots/step_0000006"
    shutil.copytree(tmp_path / "straight" / snap, tmp_path / "resumed" / snap)
    train(_cfg(tmp_path / "resumed", log_every=3, **kw))
    a, _ = load_snapshot(tmp_path / "straight")
    b, _ = load_snapshot(tmp_path / "resumed")
    assert a["updater"]["rollback"]["rollbacks"] == 1 == b["updater"]["rollback"]["rollbacks"]
    assert _same(a["model"], b["model"])
