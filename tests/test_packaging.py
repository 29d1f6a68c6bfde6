"""Build the sdist and wheel offline, install the wheel into a fresh virtual environment and
import the public API from there (not from the source tree)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import venv
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Runs inside the new environment; prints what the test checks.
PROBE = """
import importlib.metadata as md, importlib.resources as res, json, sys
import isotrain
from isotrain import *  # every name in __all__ must resolve
missing = [n for n in isotrain.__all__ if not hasattr(isotrain, n)]
print(json.dumps({
    "file": isotrain.__file__,
    "py_typed": res.files("isotrain").joinpath("py.typed").is_file(),
    "version": md.version("isotrain"),
    "missing": missing,
    "n_names": len(isotrain.__all__),
    "train_loaded": "isotrain.train" in sys.modules,
}))
"""


def run(*cmd: str | Path, cwd: Path) -> str:
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=240, env=_env()
    )
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return env | {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def copy_source(dst: Path) -> Path:
    """The files a build reads, copied so the build never writes into the shared tree."""
    dst.mkdir()
    shutil.copy2(ROOT / "pyproject.toml", dst)
    for extra in ("README.md", "LICENSE", "MANIFEST.in"):
        if (ROOT / extra).is_file():
            shutil.copy2(ROOT / extra, dst)
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
    shutil.copytree(ROOT / "src", dst / "src", ignore=skip)
    return dst


def check_metadata(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(meta_name).decode())
        entry_points = zf.read(meta_name.replace("METADATA", "entry_points.txt")).decode()
    assert "isotrain/py.typed" in names
    assert "isotrain/train/cli/main.py" in names
    assert meta["Name"] == "isotrain" and meta["Requires-Python"].startswith(">=")
    requires = meta.get_all("Requires-Dist") or []
    core = [r for r in requires if "extra ==" not in r]
    assert any(r.startswith("torch>=") for r in core), core
    assert not [r for r in requires if "==" in r.split(";")[0]], "use lower bounds, not pins"
    assert {"plots", "bench", "dev"} <= set(meta.get_all("Provides-Extra") or [])
    assert "isotrain = isotrain.train.cli.main:main" in entry_points


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_imports(tmp_path: Path) -> None:
    src = copy_source(tmp_path / "src_copy")
    dist = tmp_path / "dist"
    # Offline: no isolated build env; the build backend (setuptools) comes from this venv.
    run(sys.executable, "-m", "build", "--no-isolation", "--skip-dependency-check",
        "--outdir", dist, src, cwd=tmp_path)  # fmt: skip
    (wheel,) = dist.glob("isotrain-*.whl")
    (sdist,) = dist.glob("isotrain-*.tar.gz")
    check_metadata(wheel)
    with tarfile.open(sdist) as tf:
        members = {m.split("/", 1)[-1] for m in tf.getnames()}
    assert {"pyproject.toml", "PKG-INFO", "src/isotrain/py.typed"} <= members

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)  # bare and fast; this venv's pip installs into it
    py = env_dir / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")
    run(sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index",
        "--quiet", wheel, cwd=tmp_path)  # fmt: skip
    # Let the new venv see torch & co. from this one. A .pth *line* only extends sys.path; the
    # .pth files there (our editable install) are not processed, so the source tree stays out.
    site = Path(run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                    cwd=tmp_path).strip())  # fmt: skip
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "_isotrain_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")

    probe = json.loads(run(py, "-c", PROBE, cwd=tmp_path).strip().splitlines()[-1])
    assert Path(probe["file"]).resolve().is_relative_to(env_dir.resolve()), probe["file"]
    assert not Path(probe["file"]).resolve().is_relative_to(ROOT)
    assert probe["py_typed"] is True
    assert probe["version"] == wheel.name.split("-")[1]
    assert probe["missing"] == [] and probe["n_names"] > 10
    assert probe["train_loaded"] is False  # the patterns import without the trainer
    assert (env_dir / "bin" / "isotrain").is_file() or sys.platform == "win32"


def test_the_torch_floor_is_the_version_ci_installs() -> None:
    """pyproject's floor, the Makefile's pin and _torch_private's note name one version."""
    import re

    import torch

    floor = re.search(r'"torch>=([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    pin = re.search(r"TORCH \?= torch==([\d.]+)", (ROOT / "Makefile").read_text()).group(1)
    note = (ROOT / "src" / "isotrain" / "_torch_private.py").read_text()
    assert pin.startswith(floor + "."), (floor, pin)
    assert f"torch {pin}" in note
    installed = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    assert installed >= tuple(int(p) for p in floor.split(".")), torch.__version__
