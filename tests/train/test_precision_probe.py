"""`--precision auto` in a run: the header first, the probe as progress, a time budget, signals
that stop it at once, and the run directory's checks before it. Steps and clock are faked."""

import contextlib
import os
import signal
import threading
import time

import pytest

from isotrain.autograd import _cpu
from isotrain.train.cli.main import main
from isotrain.train.precision import capability, choice
from isotrain.train.precision.probe import measure

SMOKE = ["train", "--preset", "smoke", "--data.max-bytes", "60000", "--sample-tokens", "0"]


@pytest.fixture
def native(monkeypatch, tmp_path, own_cpu_kind):
    """A CPU with AVX512-BF16 flags, and a cache of this test's own."""
    monkeypatch.setenv("ISOTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(capability, "native_bf16_matmul", lambda: True)
    monkeypatch.setattr(_cpu, "_read_cpuinfo", lambda: "flags\t: avx2 avx512f avx512_bf16\n")


def fake_steps(monkeypatch, step, clock=None) -> None:
    """The probe's steps (and clock) replaced; its measuring and deciding are the real ones."""

    @contextlib.contextmanager
    def steps(cfg, device):
        yield step

    monkeypatch.setattr(choice, "model_steps", steps)
    if clock is not None:
        monkeypatch.setattr(choice, "measure", lambda s, **kw: measure(s, clock=clock, **kw))


class Fake:
    """A clock that moves only in fake steps: `seconds[mode]` per step."""

    def __init__(self, capsys=None, **seconds: float) -> None:
        self.seconds = {k.replace("_", "-"): v for k, v in seconds.items()}
        self.now, self.capsys, self.before_first = 0.0, capsys, None

    def clock(self) -> float:
        return self.now

    def step(self, mode: str) -> None:
        if self.before_first is None and self.capsys is not None:
            self.before_first = self.capsys.readouterr().out
            print(self.before_first, end="")  # noqa: T201  put it back for the whole output
        self.now += self.seconds[mode]


def test_the_header_comes_first_then_the_probe_as_progress_then_the_choice(
    tmp_path, monkeypatch, capsys, native
) -> None:
    fake = Fake(capsys, fp32=1.0, bf16=0.9, bf16_matmul=0.6)
    fake_steps(monkeypatch, fake.step, fake.clock)
    argv = [*SMOKE, "--precision", "auto", "--steps", "2", "--out-dir", str(tmp_path / "r")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert (
        "  precision  auto: this CPU has AVX512-BF16 but no AMX tiles; measuring fp32, bf16 "
        "and bf16-matmul steps (at most 60 s)...\n" in fake.before_first
    )
    assert "run dir    " in fake.before_first  # the whole header, before the first step
    lines = out.splitlines()
    rounds = [ln for ln in lines if ln.startswith("precision  measuring, ")]
    assert [r.split(":")[0] for r in rounds] == [
        "precision  measuring, warm-up",
        *(f"precision  measuring, round {i}/4" for i in range(1, 5)),
    ]
    chosen = lines.index(rounds[-1]) + 1
    assert lines[chosen] == (
        "precision  bf16-matmul (auto: this CPU has AVX512-BF16 but no AMX tiles; step time "
        "fp32 1.00x, bf16 0.90x, bf16-matmul 0.60x)"
    )
    assert 'precision = "bf16-matmul"' in (tmp_path / "r" / "config.toml").read_text()


def test_a_probe_past_its_budget_trains_in_fp32_and_says_so(
    tmp_path, monkeypatch, capsys, native
) -> None:
    fake = Fake(fp32=4.0, bf16=9.0, bf16_matmul=9.0)
    fake_steps(monkeypatch, fake.step, fake.clock)
    run = tmp_path / "r"
    argv = [*SMOKE, "--precision", "auto", "--precision-probe-seconds", "10", "--out-dir", str(run)]
    assert main([*argv, "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert fake.now == 13.0  # fp32 4 s, bf16 9 s; bf16-matmul (guess: 9 s) would end past 10 s
    assert (
        "precision  fp32 (auto: this CPU has AVX512-BF16 but no AMX tiles; the probe stopped at "
        "its 10 s budget after 2 step(s) (13 s), before every mode was timed, so the run takes "
        "fp32; raise "
        "--precision-probe-seconds, or pass --precision bf16 or bf16-matmul to choose yourself)"
    ) in out
    assert 'precision = "fp32"' in (run / "config.toml").read_text()


def test_a_forced_cpu_kind_is_in_the_header_and_an_unknown_one_is_refused(
    tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("ISOTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_cpu, "_read_cpuinfo", lambda: "flags\t: avx2 avx512f avx512_bf16\n")
    monkeypatch.setattr(capability.torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    fake_steps(monkeypatch, lambda mode: pytest.fail("probed where bf16 is emulated"))
    monkeypatch.setenv("ISOTRAIN_CPU_KIND", "avx2")
    argv = [*SMOKE, "--precision", "auto", "--steps", "1", "--out-dir", str(tmp_path / "r")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert (
        "  cpu kind   avx2, forced by ISOTRAIN_CPU_KIND: this CPU has AVX512-BF16 but no AMX "
        "tiles, ATen's kernels AVX512\n"
    ) in out
    assert (
        "  precision  fp32 (auto: this CPU has neither AMX tiles nor AVX512-BF16 "
        "(ISOTRAIN_CPU_KIND=avx2): bf16 is emulated (AVX2), so fp32 is faster)\n"
    ) in out
    monkeypatch.setenv("ISOTRAIN_CPU_KIND", "avx512")
    assert main([*argv[:-1], str(tmp_path / "bad")]) == 2
    assert capsys.readouterr().err == (
        "isotrain train: error: ISOTRAIN_CPU_KIND='avx512' is not a CPU kind: use one of avx2, "
        "avx512-bf16, amx, or unset it to read this CPU's flags\n"
    )
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_a_slow_probe_at_once(
    tmp_path, monkeypatch, capsys, native, signum, code
) -> None:
    def slow_step(mode: str) -> None:
        threading.Timer(0.2, os.kill, (os.getpid(), signum)).start()
        time.sleep(30)  # a step of a model too big to time; the signal ends it

    fake_steps(monkeypatch, slow_step)
    run = tmp_path / "r"
    start = time.monotonic()
    assert main([*SMOKE, "--precision", "auto", "--out-dir", str(run)]) == code
    assert time.monotonic() - start < 10
    assert f"interrupted ({signal.Signals(signum).name})" in capsys.readouterr().err
    assert not (run / "snapshots").exists() and not (tmp_path / "precision.json").exists()


def test_the_run_directory_is_checked_before_the_probe(tmp_path, monkeypatch, capsys, native):
    run = tmp_path / "r"
    assert main([*SMOKE, "--steps", "2", "--out-dir", str(run)]) == 0  # fp32 (the preset)
    fake_steps(monkeypatch, lambda mode: pytest.fail("probed before the run directory's checks"))
    capsys.readouterr()
    auto = [*SMOKE, "--precision", "auto", "--steps", "2", "--out-dir", str(run)]
    assert main(auto) == 0
    assert f"{run} is complete: it trained 2 of --steps 2" in capsys.readouterr().out
    assert main([*auto, "--no-auto-resume"]) == 2
    assert "already holds a run; pass --resume" in capsys.readouterr().err
