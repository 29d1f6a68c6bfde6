"""Run every script in examples/ in --smoke mode, in-process, and check what it prints.

Each example is loaded from its file (it is not a package) and its ``main(argv)`` called, so the
test pays no interpreter start-up and the autouse isolation audit sees any state it leaks.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NUM = r"(-?\d+(?:\.\d+)?|nan|inf)"


def load(name: str) -> ModuleType:
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_isotrain_example_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered for good: dataclasses, pickling and torch.compile (tracing a function of this
    # module from a frame of another) look modules up by name.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run(name: str, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    capsys.readouterr()
    rc = load(name).main(["--smoke", *args])
    out = capsys.readouterr().out
    assert rc == 0, out
    return out


def grab(pattern: str, text: str) -> tuple[str, ...]:
    m = re.search(pattern, text)
    assert m is not None, f"{pattern!r} not found in output:\n{text}"
    return m.groups()


def check_seed_loop(capsys: pytest.CaptureFixture[str]) -> None:
    out = run("seed_loop", capsys)
    assert "bytes of stdlib source; autocast:" in out
    first, last, skipped = grab(rf"val loss {NUM} -> {NUM}, skipped steps (\d+)", out)
    assert float(last) < float(first) - 1.0  # ln(256) = 5.5 nats -> well below
    assert skipped == "0"
    assert "sample: def " in out


def check_qat_finetune(capsys: pytest.CaptureFixture[str]) -> None:
    out = run("qat_finetune", capsys)
    (fp32,) = grab(rf"float32 after pre-training: val loss {NUM}", out)
    before8, _, ok8 = grab(rf"8-bit: val loss before QAT {NUM} -> after QAT {NUM} "
                                r"\(params finite: (\w+);", out)  # fmt: skip
    before4, after4, ok4 = grab(rf"4-bit: val loss before QAT {NUM} -> after QAT {NUM} "
                                r"\(params finite: (\w+);", out)  # fmt: skip
    assert ok8 == ok4 == "True"
    assert abs(float(before8) - float(fp32)) < 0.02  # 8 bits barely change the model
    assert float(before4) > float(before8) + 0.02  # 4 bits visibly do ...
    assert float(after4) < float(before4) - 0.01  # ... and fine-tuning through the STE recovers


def check_memory_budget(capsys: pytest.CaptureFixture[str]) -> None:
    out = run("memory_budget", capsys)
    rows = dict(re.findall(r"^\| (\S+) \| ([\d.]+) \|", out, flags=re.M))
    saved = {k: float(v) * 1e3 for k, v in rows.items()}
    assert saved["full"] < saved["every:2"] < saved["none"], saved
    assert saved["selective"] < saved["none"], saved
    assert saved["budget:40%"] <= 0.4 * saved["none"] + 1, saved  # the budget is honoured
    (blocks,) = grab(r"\| budget:40% \| [\d.]+ \| [\d.]+ \| (\d+)/4 \|", out)
    assert 0 < int(blocks) <= 4
    first, last, applied, finite = grab(
        rf"val loss {NUM} -> {NUM} \((\d+)/\d+ steps applied, params finite: (\w+)\)", out
    )
    assert float(last) < float(first) and finite == "True" and int(applied) > 0


def check_nan_guard(capsys: pytest.CaptureFixture[str]) -> None:
    out = run("nan_guard", capsys)
    assert "params finite: False" not in out
    assert out.count("params finite: True") == 7  # six log steps and the end
    assert "step    3: skipped (NONFINITE_LOSS)" in out
    assert "step   17: skipped (NONFINITE_LOSS)" in out
    assert "rollback #1 to step" in out
    (losses,) = grab(r"'NONFINITE_LOSS': (\d+)", out)
    assert losses == "8"  # steps 3, 17 and the burst of six
    (val,) = grab(rf"val mse {NUM}", out)
    assert val not in ("nan", "inf")
    # The device-side path (selection, sync-free step) must train exactly like the host path.
    select = run("nan_guard", capsys, "--skip-mode", "select", "--forbid-syncs")
    assert select == out


def check_compile_buckets(capsys: pytest.CaptureFixture[str]) -> None:
    out = run("compile_buckets", capsys, "--backend", "eager")
    (warm,) = grab(r"warm-up: (\d+) compilations", out)
    assert int(warm) >= 3  # one graph (at least) per bucket, compiled before training
    first, last = grab(rf"train loss {NUM} -> {NUM}", out)
    assert float(last) < float(first)
    assert "after warm-up: 0 compilations, 0 recompiles" in out


def check_cpu_bf16(capsys: pytest.CaptureFixture[str]) -> None:
    out = run("cpu_bf16", capsys)
    assert re.search(r"native bf16 matmul on this CPU: (True|False)", out)
    a0, a1, _ = grab(rf"nn.Linear:  loss {NUM} -> {NUM}, {NUM} ms/step", out)
    b0, b1, _ = grab(rf"Bf16Linear: loss {NUM} -> {NUM}, {NUM} ms/step", out)
    assert a0 == b0 and float(a1) < float(a0)  # same start; both train
    assert abs(float(b1) - float(a1)) <= 0.01 * float(a1)  # the same arithmetic, to bf16 rounding


def check_hf_transformers(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    with pytest.warns(UserWarning, match="now run with use_cache=False"):  # HF's default, said
        out = run("hf_transformers", capsys)
    assert "quantized 8 layer(s), left 3" in out and "excluded by 'lm_head'" in out
    assert "step 3: skipped (NONFINITE_LOSS)" in out and "params finite: True" in out
    first, last = grab(rf"train loss {NUM} -> {NUM}", out)
    assert float(last) < float(first) - 1.0
    compiled, calls, eager = grab(r"after warm-up: 0 compilations, (\d+) of (\d+) block calls "
                                  r"compiled, eager block calls: (\d+)", out)  # fmt: skip
    assert compiled == calls and int(calls) > 0 and eager == "0"
    assert "state leaks: none" in out


def check_doctor_setup(capsys: pytest.CaptureFixture[str]) -> None:
    out = run("doctor_setup", capsys)
    first, last = grab(rf"val loss {NUM} -> {NUM}", out)
    assert float(last) < float(first) - 0.3
    assert out.count("  loss ") == 4  # four log lines; importing the file (below) trains nothing
    capsys.readouterr()
    setup = load("doctor_setup").doctor_setup()
    assert capsys.readouterr().out == ""
    from isotrain.doctor import examine  # the doctor CLI's run: tests/doctor/test_doctor_cli.py

    assert set(setup) <= set(inspect.signature(examine).parameters)


def _step_line(out: str, step: int) -> tuple[str, str]:
    """(lr, rest of the line) of an example's "step N  loss L  lr R  ..." log line."""
    lr, rest = grab(rf"step {step:3d}  loss {NUM}  lr {NUM}  (.*)", out)[1:]
    return lr, rest


def check_hf_trainer(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    out = run("hf_trainer", capsys)
    (lr4, ok4), (lr5, skip5), (lr6, ok6) = (_step_line(out, s) for s in (4, 5, 6))
    assert skip5 == "grad_norm nan  skipped_steps 1 (NONFINITE_GRAD)"
    assert ok4.endswith("skipped_steps 0 (OK)") and ok6.endswith("skipped_steps 0 (OK)")
    assert lr6 == lr5 != lr4  # the schedule did not advance on the skipped step
    first, last = grab(rf"eval loss {NUM} -> {NUM}, params finite: True", out)
    assert float(last) < float(first)
    assert "11/12 steps applied" in out
    assert "plain Trainer with the same NaN: params finite: False" in out


def check_lightning_trainer(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("lightning")
    out = run("lightning_trainer", capsys)
    (lr4, ok4), (lr5, skip5), (lr6, ok6) = (_step_line(out, s) for s in (4, 5, 6))
    assert (ok4, skip5, ok6) == ("skipped_steps 0 (OK)", "skipped_steps 1 (NONFINITE_GRAD)",
                                 "skipped_steps 1 (OK)")  # fmt: skip
    assert lr5 == lr4 != lr6  # the schedule did not advance on the skipped step
    assert "11/12 steps applied" in out and "params finite: True" in out
    assert "plain Lightning with the same NaN: params finite: False" in out


CHECKS: dict[str, Callable[[pytest.CaptureFixture[str]], None]] = {
    "seed_loop": check_seed_loop,
    "qat_finetune": check_qat_finetune,
    "memory_budget": check_memory_budget,
    "nan_guard": check_nan_guard,
    "compile_buckets": check_compile_buckets,
    "cpu_bf16": check_cpu_bf16,
    "hf_transformers": check_hf_transformers,
    "hf_trainer": check_hf_trainer,
    "lightning_trainer": check_lightning_trainer,
    "doctor_setup": check_doctor_setup,
}


def test_every_example_has_a_smoke_check() -> None:
    found = sorted(p.stem for p in EXAMPLES.glob("*.py"))
    assert found == sorted(CHECKS), "add a check_<name> for each example in examples/"


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_example_smoke(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    CHECKS[name](capsys)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_example_is_short_standalone_and_documented(name: str) -> None:
    text = (EXAMPLES / f"{name}.py").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 130, "keep examples short: split or simplify"
    assert "isotrain.train" not in text, "examples show the patterns without the trainer"
    assert f"python examples/{name}.py" in text, "say how to run it in the module docstring"
    doc = text.split('"""')[1]
    assert re.search(r"[Mm]easured .*\d+ (s|min)", " ".join(doc.split())), "state the measured time"
    assert '"--smoke"' in text and "def main(argv" in text
