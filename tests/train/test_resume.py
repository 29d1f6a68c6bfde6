"""Snapshots and exact resume: N steps straight == k steps + resume for N - k, bit for bit."""

import dataclasses
import os
import shutil
import signal

import pytest
import torch

from isotrain.train import config as C
from isotrain.train.loop import train
from isotrain.train.report import read_metrics
from isotrain.train.resume import stop_on_signals
from isotrain.train.snapshot import SnapshotError, find_snapshots, load_snapshot, save_snapshot


def _cfg(out, **kw) -> C.TrainConfig:
    base = C.PRESETS["smoke"]()
    return dataclasses.replace(
        base,
        model=dataclasses.replace(base.model, dropout=0.1),  # the RNG state matters
        data=dataclasses.replace(base.data, max_bytes=60_000),
        snapshot=C.SnapshotConfig(every=3, keep=10),
        **{
            "steps": 7,
            "eval_every": 2,
            "log_every": 1,
            "sample_tokens": 4,
            "out_dir": str(out),
            **kw,
        },
    )


def _tensors(obj, prefix=""):
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}[{i}]")


def test_resume_is_bit_exact(tmp_path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(_cfg(straight))
    (resumed / "snapshots").mkdir(parents=True)
    shutil.copytree(straight / "snapshots" / "step_0000003", resumed / "snapshots" / "step_0000003")
    state = train(_cfg(resumed))
    assert state.step == 7
    a, _ = load_snapshot(straight)
    b, _ = load_snapshot(resumed)
    ta, tb = dict(_tensors(a["model"])), dict(_tensors(b["model"]))
    ta.update(_tensors(a["optimizer"], "opt")), tb.update(_tensors(b["optimizer"], "opt"))
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name

    def loss(run):
        return {r["step"]: r["loss"] for r in read_metrics(run) if r["kind"] == "train"}

    la, lb = loss(straight), loss(resumed)
    assert {s: la[s] for s in lb} == lb and max(lb) == 7 and min(lb) == 4


def test_resume_refuses_a_shape_change(tmp_path) -> None:
    train(_cfg(tmp_path, steps=3))
    cfg = _cfg(tmp_path, steps=5)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, d_model=64))
    with pytest.raises(
        C.ConfigError,
        match=r"cannot resume: --model.d-model is 64 but the snapshot was trained with 32",
    ):
        train(cfg)


def test_auto_resume_off_refuses_a_used_directory(tmp_path) -> None:
    train(_cfg(tmp_path, steps=3))
    with pytest.raises(C.ConfigError, match="already holds a run; pass --resume"):
        train(_cfg(tmp_path, steps=5, auto_resume=False))


def test_resume_flag_requires_a_snapshot(tmp_path) -> None:
    with pytest.raises(C.ConfigError, match="no snapshot there to resume from"):
        train(_cfg(tmp_path / "x", resume=str(tmp_path / "empty")))


def test_keeps_last_k_plus_best_and_pointer_written_last(tmp_path) -> None:
    for step, val in [(1, 3.0), (2, 1.0), (3, 2.0), (4, 2.5)]:
        save_snapshot(tmp_path, {"x": torch.tensor(step)}, step=step, val_loss=val, keep=2)
    names = [p.name for p in find_snapshots(tmp_path)]
    assert names == ["step_0000002", "step_0000003", "step_0000004"]
    assert (tmp_path / "snapshots" / "BEST").read_text() == "step_0000002"
    best, _path = load_snapshot(tmp_path, which="best")
    assert int(best["x"]) == 2


def test_corrupted_snapshot_falls_back_to_previous(tmp_path, caplog) -> None:
    for step in (1, 2):
        save_snapshot(tmp_path, {"x": torch.tensor(step)}, step=step, keep=5)
    state = tmp_path / "snapshots" / "step_0000002" / "state.pt"
    state.write_bytes(state.read_bytes()[:-10])  # truncated write
    payload, path = load_snapshot(tmp_path)
    assert int(payload["x"]) == 1 and path.name == "step_0000001"
    assert "checksum does not match" in caplog.text


def test_leftover_temporary_directory_is_ignored(tmp_path) -> None:
    save_snapshot(tmp_path, {"x": torch.tensor(1)}, step=1)
    (tmp_path / "snapshots" / ".tmp_step_0000002_999").mkdir()  # a crash mid-write
    assert [p.name for p in find_snapshots(tmp_path)] == ["step_0000001"]


def test_snapshot_never_executes_code(tmp_path) -> None:
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    save_snapshot(tmp_path, {"x": Evil()}, step=1)
    with pytest.raises(SnapshotError, match="every snapshot is damaged"):
        load_snapshot(tmp_path)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signals_become_a_stop_flag_and_handlers_are_restored(signum) -> None:
    before = signal.getsignal(signum)
    with stop_on_signals() as stop:
        assert not stop
        os.kill(os.getpid(), signum)  # Ctrl-C / a scheduler's preemption notice
        assert stop and stop.signal == signum
    assert signal.getsignal(signum) is before


def test_safe_changes_on_resume_are_accepted_and_logged(tmp_path, caplog) -> None:
    train(_cfg(tmp_path, steps=3))
    with caplog.at_level("WARNING", logger="isotrain.train.resume"):
        state = train(_cfg(tmp_path, steps=5, log_every=2))
    assert state.step == 5
    assert "changed on resume: --steps: 3 -> 5" in caplog.text
    assert "changed on resume: --log-every: 1 -> 2" in caplog.text
