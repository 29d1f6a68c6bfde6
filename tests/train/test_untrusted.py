"""A run directory is untrusted input: a pickle that runs code, planted in any file of a
sharded or an unsharded snapshot (checksums recomputed, as an attacker with write access
would), never runs under `train` (a torchrun-style resume included), `sample` or `export`;
the run falls back to the previous snapshot or stops with a one-line error."""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
from pathlib import Path

import pytest
from tests.worlds import ENV, free_port

from isotrain.train import config as C
from isotrain.train.cli.main import main
from isotrain.train.loop import train
from isotrain.train.rundir.integrity import sha256
from isotrain.train.rundir.safe_dcp import read_metadata
from isotrain.train.rundir.snapshot import load_snapshot

# The planted pickles use protocol 4; torch warns before refusing them, which is the point.
pytestmark = pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")

SMOKE = ["--preset", "smoke", "--data.max-bytes", "60000", "--sample-tokens", "0"]


class Evil:
    """Unpickling this creates the file `marker`: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def _item_offset(shards: Path, where: str) -> int:
    """Where DCP stored a weight (`tensor`) or a non-tensor item such as an optimizer
    hyperparameter (`bytes`, read with torch.load(weights_only=False) by DCP's own planner)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = read_metadata(shards, {p.name for p in shards.iterdir()})
    for index, info in md.storage_data.items():
        is_bytes = isinstance(md.state_dict_metadata[index.fqn], BytesStorageMetadata)
        if (where == "bytes") == is_bytes and (is_bytes or index.fqn.startswith("model.")):
            return info.offset
    raise AssertionError(f"no {where} item")


def _plant(run: Path, target: str, marker: Path) -> None:
    """Overwrite `target` of the newest snapshot (step 2) with a code-running pickle of the
    same size, and recompute its checksum in meta.json."""
    snap = run / "snapshots" / "step_0000002"
    rel, _, where = target.partition("@")
    path = run / "snapshots" / "LATEST" if rel == "LATEST" else snap / rel
    data, evil = bytearray(path.read_bytes()), pickle.dumps(Evil(marker))
    at = _item_offset(snap / "shards", where) if where else 0
    data[at : at + len(evil)] = evil
    path.write_bytes(bytes(data))
    meta = json.loads((snap / "meta.json").read_bytes()) if rel != "meta.json" else {}
    if rel in meta.get("files", {}):
        meta["files"][rel] = sha256(path)
        (snap / "meta.json").write_text(json.dumps(meta))


def _world_of_one(monkeypatch) -> None:
    for v, value in zip(ENV, ("0", "1", "0", "127.0.0.1", str(free_port()))):
        monkeypatch.setenv(v, value)


def _cfg(out: Path, mode: str, steps: int) -> C.TrainConfig:
    base = C.PRESETS["smoke"]()
    return dataclasses.replace(
        base,
        data=dataclasses.replace(base.data, max_bytes=60_000),
        parallel=C.ParallelConfig(mode=mode),
        snapshot=C.SnapshotConfig(every=1, keep=5),
        steps=steps,
        eval_every=100,
        sample_tokens=0,
        out_dir=str(out),
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Two snapshots (steps 1 and 2) of a plain and of an FSDP run."""
    root = tmp_path_factory.mktemp("untrusted")
    train(_cfg(root / "plain", "none", 2))
    with pytest.MonkeyPatch.context() as mp:
        _world_of_one(mp)
        train(_cfg(root / "fsdp", "fsdp", 2))
    return {"plain": root / "plain", "fsdp": root / "fsdp"}


CASES = [
    *(("plain", t) for t in ("state.pt", "meta.json", "LATEST")),
    *(("fsdp", t) for t in ("state.pt", "meta.json", "LATEST", "shards/.metadata")),
    *(("fsdp", t) for t in ("shards/__0_0.distcp@tensor", "shards/__0_0.distcp@bytes")),
]


@pytest.mark.parametrize(("kind", "target"), CASES, ids=[f"{k}:{t}" for k, t in CASES])
def test_planted_pickle_never_runs(runs, kind, target, tmp_path, monkeypatch, capsys) -> None:
    marker, run = tmp_path / "pwned", tmp_path / "run"
    shutil.copytree(runs[kind], run)
    _plant(run, target, marker)
    # sample and export: the previous snapshot, or a one-line error naming the shards (a
    # planted LATEST is ignored; the hyperparameters in the shards are not read for weights)
    intact = "step_0000002" if target == "LATEST" or target.endswith("@bytes") else "step_0000001"
    for argv in (["sample", "--run", str(run), "--tokens", "4"], ["export", "--run", str(run)]):
        code = main(argv)
        out, err = capsys.readouterr()
        assert not marker.exists(), argv
        if code == 2:  # only a shard read after verification can fail this late
            assert target.startswith("shards/") and "its shards do not load" in err, err
            assert err.count("\n") == 1 and "Traceback" not in err
        else:
            assert code == 0 and "Traceback" not in err
            assert argv[0] == "sample" or f"(weights of {intact})" in out
    # train: resume falls back to step 1 and trains step 2 again (under FSDP: in a gloo world)
    if kind == "fsdp":
        _world_of_one(monkeypatch)
    state = train(_cfg(run, kind if kind == "fsdp" else "none", 3))
    assert not marker.exists() and state.step == 3
    assert load_snapshot(run)[1].name == "step_0000003"
