"""Snapshots and exact resume: N steps straight == k steps + resume for N - k, bit for bit."""

import dataclasses
import json
import os
import shutil
import signal

import pytest
import torch
from tests.train.trained import tensors

from isotrain.train import config as C
from isotrain.train.loop import train
from isotrain.train.rundir.metrics import read_metrics
from isotrain.train.rundir.resume import stop_on_signals
from isotrain.train.rundir.snapshot import (
    SnapshotError,
    find_snapshots,
    load_snapshot,
    save_snapshot,
)


def _cfg(out, **kw) -> C.TrainConfig:
    base = C.PRESETS["smoke"]()
    return dataclasses.replace(
        base,
        model=dataclasses.replace(base.model, dropout=0.1),  # the RNG state matters
        data=dataclasses.replace(base.data, max_bytes=60_000),
        **{
            "snapshot": C.SnapshotConfig(every=3, keep=10),
            "steps": 7,
            "eval_every": 2,
            "log_every": 1,
            "sample_tokens": 4,
            "out_dir": str(out),
            **kw,
        },
    )


def test_resume_is_bit_exact(tmp_path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(_cfg(straight))
    (resumed / "snapshots").mkdir(parents=True)
    shutil.copytree(straight / "snapshots" / "step_0000003", resumed / "snapshots" / "step_0000003")
    state = train(_cfg(resumed))
    assert state.step == 7
    a, _ = load_snapshot(straight)
    b, _ = load_snapshot(resumed)
    ta, tb = dict(tensors(a["model"])), dict(tensors(b["model"]))
    ta.update(tensors(a["optimizer"], "opt")), tb.update(tensors(b["optimizer"], "opt"))
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
        match=r"cannot resume .*: its model has another shape \(it has --model.d-model 32; "
        r"this command: 64\); pass that to continue it",
    ):
        train(cfg)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, d_model=32, bias=False))
    with pytest.raises(C.ConfigError) as info:
        train(cfg)
    assert str(info.value) == (  # the fix is a flag the CLI accepts (not "--model.bias True")
        f"cannot resume {cfg.out_dir}: its model has another shape (it has --model.bias; this "
        "command: False); pass that to continue it, or a new --out-dir for a new run, or "
        f"--init-from {cfg.out_dir} to start a new run from its weights"
    )


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
    best, _path = load_snapshot(tmp_path, which="best", check=None)
    assert int(best["x"]) == 2


def test_corrupted_snapshot_falls_back_to_previous(tmp_path, caplog) -> None:
    for step in (1, 2):
        save_snapshot(tmp_path, {"x": torch.tensor(step)}, step=step, keep=5)
    state = tmp_path / "snapshots" / "step_0000002" / "state.pt"
    state.write_bytes(state.read_bytes()[:-10])  # truncated write
    payload, path = load_snapshot(tmp_path, check=None)
    assert int(payload["x"]) == 1 and path.name == "step_0000001"
    assert "state.pt is damaged: its checksum does not match" in caplog.text


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
        load_snapshot(tmp_path, check=None)


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
    with caplog.at_level("WARNING", logger="isotrain.train.rundir.resume"):
        state = train(_cfg(tmp_path, steps=5, log_every=2))
    assert state.step == 5
    assert "changed on resume: --steps: 3 -> 5" in caplog.text
    assert "changed on resume: --log-every: 1 -> 2" in caplog.text


def test_settings_a_snapshot_predates_or_auto_decides_later_are_no_change() -> None:
    from isotrain.train.rundir.resume import check_compatible

    cfg = dataclasses.asdict(_cfg("r", precision="bf16"))
    saved = {k: v for k, v in cfg.items() if k != "precision_probe_seconds"}  # an older run
    assert check_compatible(saved, _cfg("r", precision="bf16", steps=9)) == ["--steps: 7 -> 9"]
    assert check_compatible(saved, _cfg("r", precision="auto")) == []  # the probe decides later
    assert check_compatible(saved, _cfg("r", precision="fp32")) == ["--precision: 'bf16' -> 'fp32'"]


# ------------------------------------------------------------ untrusted pointers and files
def _saved(run, steps=(1, 2)) -> None:
    for step in steps:
        save_snapshot(run, {"x": torch.tensor(step)}, step=step, keep=5)


@pytest.mark.parametrize(
    "latest",
    [
        b"../../other/snapshots/step_0000005",
        b"ABSOLUTE",
        b"step_0000005/../../../other/snapshots/step_0000005",
        b"\xff\xfe\x00step",
        b"",
    ],
)
def test_latest_never_leads_out_of_the_run(tmp_path, caplog, latest) -> None:
    run, other = tmp_path / "run", tmp_path / "other"
    _saved(run)
    _saved(other, (5,))
    target = str(other / "snapshots" / "step_0000005").encode()
    (run / "snapshots" / "LATEST").write_bytes(target if latest == b"ABSOLUTE" else latest)
    with caplog.at_level("WARNING"):
        payload, path = load_snapshot(run, check=None)
    assert path == run / "snapshots" / "step_0000002" and int(payload["x"]) == 2
    assert len(caplog.records) == 1 and "not the name of a snapshot" in caplog.text


def test_linked_snapshots_are_refused(tmp_path, caplog) -> None:
    run, other = tmp_path / "run", tmp_path / "other"
    _saved(run)
    _saved(other, (5,))
    (run / "snapshots" / "step_0000009").symlink_to(other / "snapshots" / "step_0000005")
    (run / "snapshots" / "LATEST").write_text("step_0000009")
    with caplog.at_level("WARNING"):
        assert load_snapshot(run, check=None)[1].name == "step_0000002"
    assert "step_0000009: a link, or outside the run directory" in caplog.text
    assert [p.name for p in find_snapshots(run)] == ["step_0000001", "step_0000002"]
    shutil.rmtree(run / "snapshots")
    (run / "snapshots").symlink_to(other / "snapshots")
    with pytest.raises(SnapshotError, match="leads out of the run directory"):
        load_snapshot(run, check=None)


@pytest.mark.parametrize(
    "meta",
    [b"[]", b"null", b'"step"', b"{}", b"\xff\xfe", b'{"format_version": 2, "step": 2}'],
)
def test_malformed_meta_falls_back_with_one_warning(tmp_path, caplog, meta) -> None:
    _saved(tmp_path)
    (tmp_path / "snapshots" / "step_0000002" / "meta.json").write_bytes(meta)
    with caplog.at_level("WARNING"):
        assert load_snapshot(tmp_path, check=None)[1].name == "step_0000001"
    assert len(caplog.records) == 1 and "skipping damaged snapshot" in caplog.text
    assert "\n" not in caplog.records[0].getMessage()


def test_a_renamed_snapshot_is_refused(tmp_path, caplog) -> None:
    _saved(tmp_path)
    snaps = tmp_path / "snapshots"
    (snaps / "step_0000002").rename(snaps / "step_0000007")
    assert load_snapshot(tmp_path, check=None)[1].name == "step_0000001"
    assert "meta.json names step 2" in caplog.text


def test_format_1_snapshots_still_load(tmp_path) -> None:
    snap = tmp_path / "snapshots" / "step_0000003"
    snap.mkdir(parents=True)
    torch.save({"format_version": 1, "x": torch.tensor(3), "sharded": False}, snap / "state.pt")
    from isotrain.train.rundir.integrity import sha256

    meta = {"format_version": 1, "step": 3, "val_loss": None, "sha256": sha256(snap / "state.pt")}
    (snap / "meta.json").write_text(json.dumps(meta))
    assert int(load_snapshot(tmp_path, check=None)[0]["x"]) == 3


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A real run with snapshots at steps 1 and 2."""
    run = tmp_path_factory.mktemp("two") / "run"
    train(_cfg(run, steps=2, eval_every=100, snapshot=C.SnapshotConfig(every=1, keep=5)))
    return run


def _rewrite_state(snap, change) -> None:
    """Replace state.pt by `change(payload)`, with a valid checksum (a well-formed lie)."""
    from isotrain.train.rundir.integrity import sha256

    payload = torch.load(snap / "state.pt", weights_only=True)
    torch.save(change(payload), snap / "state.pt")
    meta = json.loads((snap / "meta.json").read_text())
    meta["files"]["state.pt"] = sha256(snap / "state.pt")
    (snap / "meta.json").write_text(json.dumps(meta))


def _shape(p):
    p["model"]["wte.weight"] = torch.zeros(3, 3)
    return p


@pytest.mark.parametrize(
    "change",
    [
        lambda p: [p],
        lambda p: {**p, "model": None},
        lambda p: {**p, "config": {**p["config"], "model": {**p["config"]["model"], "bias": 1}}},
        _shape,
        lambda p: {**p, "train_state": {**p["train_state"], "step": "2"}},
        lambda p: {**p, "optimizer": {"state": {}, "param_groups": []}},
    ],
    ids=["a-list", "no-model", "bias-1", "wrong-shape", "step-str", "empty-optimizer"],
)
def test_well_formed_lies_in_state_pt_fall_back_on_resume(two_steps, tmp_path, caplog, change):
    run = tmp_path / "run"
    shutil.copytree(two_steps, run)
    _rewrite_state(run / "snapshots" / "step_0000002", change)
    with caplog.at_level("INFO"):
        state = train(_cfg(run, steps=3, eval_every=100, snapshot=C.SnapshotConfig(every=1)))
    assert state.step == 3
    assert "skipping damaged snapshot" in caplog.text and "step_0000001 at step 1" in caplog.text


def test_latest_of_another_run_leaves_both_runs_alone(two_steps, tmp_path, caplog) -> None:
    run, other = tmp_path / "run", tmp_path / "other"
    shutil.copytree(two_steps, run)
    shutil.copytree(two_steps, other)
    before = {p: p.read_bytes() for p in other.rglob("*") if p.is_file()}
    (run / "snapshots" / "LATEST").write_text("../../other/snapshots/step_0000002")
    with caplog.at_level("INFO"):
        train(_cfg(run, steps=3, eval_every=100, snapshot=C.SnapshotConfig(every=1, keep=5)))
    assert f"resumed from {run / 'snapshots' / 'step_0000002'} at step 2" in caplog.text
    assert {p: p.read_bytes() for p in other.rglob("*") if p.is_file()} == before
