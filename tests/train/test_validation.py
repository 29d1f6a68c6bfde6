"""Every bad value is refused at the boundary: one line `error: ... try ...`, exit 2, no
traceback, through flags and through TOML alike, and an existing run directory is left byte
for byte as it was."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from isotrain.train.cli.main import main
from isotrain.train.environment import install_hint

SMOKE = ["--preset", "smoke", "--data.max-bytes", "60000", "--sample-tokens", "0"]
HUGE = str(2**70)

# (id, flags, TOML text or None, the whole error after "isotrain train: error: ")
# <file> is a regular file, <toml> the TOML file of the case: both are filled in per test.
TRAIN_CASES = [
    ("lr-inf", ["--optim.lr", "inf"], None,
     "--optim.lr inf is invalid: it must be a finite number; try --optim.lr 0.004"),
    ("lr-inf", [], "[optim]\nlr = inf\n",
     "--config <toml>: optim.lr = inf is invalid: it must be a finite number; "
     "try [optim] lr = 0.002"),
    ("weight-decay-inf", ["--optim.weight-decay", "inf"], None,
     "--optim.weight-decay inf is invalid: it must be a finite number; "
     "try --optim.weight-decay 0.1"),
    ("weight-decay-inf", [], "[optim]\nweight_decay = inf\n",
     "--config <toml>: optim.weight_decay = inf is invalid: it must be a finite number; "
     "try [optim] weight_decay = 0.1"),
    ("dropout-nan", ["--model.dropout", "nan"], None,
     "--model.dropout nan is invalid: it must be a finite number; try --model.dropout 0.0"),
    ("precision-fp8", ["--precision", "fp8"], None,
     "--precision fp8 is not one of auto, fp32, bf16, bf16-matmul, fp16; try --precision fp32"),
    ("precision-fp8", [], 'precision = "fp8"\n',
     "--config <toml>: precision = \"fp8\" is invalid: it must be one of 'auto', 'fp32', "
     "'bf16', 'bf16-matmul', 'fp16'; try precision = \"fp32\""),
    ("subnormals-off", ["--subnormals", "off"], None,
     "--subnormals off is not one of flush, keep; try --subnormals flush"),
    ("subnormals-off", [], 'subnormals = "off"\n',
     "--config <toml>: subnormals = \"off\" is invalid: it must be one of 'flush', 'keep'; "
     "try subnormals = \"flush\""),
    ("steps-true", ["--steps", "true"], None,
     "--steps true is not an integer; try --steps 8"),
    ("steps-true", [], "steps = true\n",
     "--config <toml>: steps = true is invalid: it must be an integer; try steps = 8"),
    ("steps-string", [], 'steps = "8"\n',
     "--config <toml>: steps = \"8\" is invalid: it must be an integer; try steps = 8"),
    ("bias-int", [], "[model]\nbias = 1\n",
     "--config <toml>: model.bias = 1 is invalid: it must be true or false; "
     "try [model] bias = true"),
    ("buckets-bool", [], "[data]\nbuckets = [16, true]\n",
     "--config <toml>: data.buckets = [16, true] is invalid: it must be a list of integers; "
     "try [data] buckets = []"),
    ("inject-nan-negative", ["--guard.inject-nan-at", "-3"], None,
     "--guard.inject-nan-at -3 is invalid: steps are numbered from 1; "
     "try --guard.inject-nan-at 3 (or leave it out)"),
    ("inject-nan-negative", [], "[guard]\ninject_nan_at = [-3]\n",
     "--guard.inject-nan-at -3 is invalid: steps are numbered from 1; "
     "try --guard.inject-nan-at 3 (or leave it out)"),
    ("rollback-negative", ["--guard.rollback-after", "-1"], None,
     "--guard.rollback-after -1 is invalid: use 0 (off) or more; "
     "try --guard.rollback-after 0"),
    ("rollback-negative", [], "[guard]\nrollback_after = -1\n",
     "--guard.rollback-after -1 is invalid: use 0 (off) or more; "
     "try --guard.rollback-after 0"),
    ("seed-negative", ["--seed", "-1"], None,
     "--seed -1 is invalid: use 0 to 2**63 - 1; try --seed 1337"),
    ("seed-huge", ["--seed", HUGE], None,
     f"--seed {HUGE} is invalid: it must fit in 64 bits; try --seed 1337"),
    ("seed-huge", [], f"seed = {HUGE}\n",
     f"--config <toml>: seed = {HUGE} is invalid: it must fit in 64 bits; try seed = 1337"),
    ("compile-mode", ["--compile.mode", "fast"], None,
     "--compile.mode fast is invalid: use one of ('default', 'reduce-overhead', "
     "'max-autotune', 'max-autotune-no-cudagraphs'); try --compile.mode None"),
    ("unknown-flag", ["--model.width", "3"], None,
     "unknown option --model.width; try isotrain train --help"),
    ("misspelt-flag", ["--stepz", "50"], None, "unknown option --stepz; did you mean --steps?"),
    ("flag-without-section", ["--lr", "1e-3"], None,
     "unknown option --lr; did you mean --optim.lr?"),
    ("steps-word", ["--steps", "fifty"], None, "--steps fifty is not an integer; try --steps 8"),
    ("steps-no-value", ["--steps"], None, "--steps needs a value; try --steps 8"),
    ("lr-word", ["--optim.lr=fast"], None, "--optim.lr fast is not a number; try --optim.lr 0.002"),
    ("switch-with-value", ["--no-progress=1"], None,
     "--no-progress takes no value; try --no-progress alone"),
    ("stray-word", ["--no-progress", "yes"], None,
     "unexpected argument 'yes'; try isotrain train --help"),
    ("unknown-key", [], "[model]\nwidth = 3\n",
     "--config <toml>: unknown setting 'model.width'; try one of n_layer, n_head, d_model, "
     "block_size, vocab_size, dropout, bias, gelu, activation, positions, qk_norm, tie_head, "
     "zero_init"),
    ("misspelt-key", [], "[model]\nd_modle = 64\n",
     "--config <toml>: unknown setting 'model.d_modle'; try 'model.d_model'"),
    ("unknown-section", [], "[modle]\nn_layer = 3\n",
     "--config <toml>: unknown setting 'modle'; try 'model'"),
    ("section-as-value", [], "model = 3\n",
     "--config <toml>: 'model' is a section; try writing it as [model]"),
    ("not-utf8", [], b"steps = 8\n# \xff\xfe\n",
     "--config <toml>: not UTF-8 text (byte 12); try saving it as UTF-8"),
    ("not-toml", [], "steps = \n",
     "--config <toml>: not valid TOML (Invalid value (at line 1, column 9)); try fixing that line"),
    ("no-toml-file", ["--config", "<file>.missing"], None,
     "--config <file>.missing: no such file; try the path of a TOML file"),
    ("out-dir-is-a-file", ["--out-dir", "<file>"], None,
     "--out-dir <file> is a file; try another --out-dir"),
    ("out-dir-is-a-file", [], 'out_dir = "<file>"\n',
     "--out-dir <file> is a file; try another --out-dir"),
    ("out-dir-under-a-file", ["--out-dir", "<file>/run"], None,
     "--out-dir <file>/run lies under the file <file>; try another --out-dir"),
    ("device-mps", ["--device", "mps"], None,
     "--device 'mps': this machine has no such device; try --device cpu"),
    ("device-mps", [], 'device = "mps"\n',
     "--device 'mps': this machine has no such device; try --device cpu"),
    ("device-cuda", ["--device", "cuda:64"], None,
     "--device 'cuda:64': this machine has no such device; try --device cpu"),
    ("tensorboard-missing", ["--report.loggers", "jsonl", "tensorboard"], None,
     "--report.loggers tensorboard needs the tensorboard package, which is not installed; "
     f"try {install_hint('tensorboard')}"),
    ("wandb-missing", ["--report.loggers", "csv,wandb"], None,
     "--report.loggers wandb needs the wandb package, which is not installed; "
     f"try {install_hint('wandb')}"),
    ("logger-unknown", ["--report.loggers", "jsonl,mlflow"], None,
     "--report.loggers mlflow is not one of jsonl, csv, tensorboard, wandb; "
     "try --report.loggers jsonl"),
    ("logger-unknown", [], '[report]\nloggers = ["jsonl", "mlflow"]\n',
     "--config <toml>: report.loggers = [\"jsonl\", \"mlflow\"] is invalid: it must be a list "
     "of values from 'jsonl', 'csv', 'tensorboard', 'wandb'; try [report] loggers = "
     "[\"jsonl\"]"),
    ("d-model-string", [], '[model]\nd_model = "big"\n',
     "--config <toml>: model.d_model = \"big\" is invalid: it must be an integer; "
     "try [model] d_model = 32"),
    ("d-model-float", [], "[model]\nd_model = 64.5\n",
     "--config <toml>: model.d_model = 64.5 is invalid: it must be an integer; "
     "try [model] d_model = 32"),
    ("lr-string", [], '[optim]\nlr = "fast"\n',
     "--config <toml>: optim.lr = \"fast\" is invalid: it must be a number; "
     "try [optim] lr = 0.002"),
    ("preset-unknown", ["--preset", "huge"], None,
     "--preset 'huge' is not a preset; try one of tiny, small, smoke, speedrun"),
    ("preset-no-value", ["--preset"], None,
     "--preset needs a value; try isotrain train --help"),
    ("help-unknown-section", ["--help", "modle"], None,
     "--help modle: no such section; try one of model, data, optim, checkpointing, compile, "
     "guard, quant, snapshot, parallel, report, doctor, run, presets"),
    ("data-missing", ["--data.path", "<file>.missing"], None,
     "--data.path <file>.missing: no such file or directory"),
]  # fmt: skip


def _files(run: Path) -> dict[str, bytes | None]:
    """Every path under `run` with its bytes (None for a directory)."""
    return {
        str(p.relative_to(run)): p.read_bytes() if p.is_file() else None for p in run.rglob("*")
    }


@pytest.fixture(scope="module")
def existing_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("existing") / "run"
    assert main(["train", *SMOKE, "--steps", "2", "--out-dir", str(run)]) == 0
    return run


def _ids() -> list[str]:
    return [f"{name}-{'toml' if toml is not None else 'flag'}" for name, _, toml, _ in TRAIN_CASES]


@pytest.mark.parametrize(("name", "flags", "toml", "expected"), TRAIN_CASES, ids=_ids())
def test_bad_values_are_one_line_and_leave_the_run_alone(
    existing_run, tmp_path, monkeypatch, capsys, name, flags, toml, expected
) -> None:
    file = tmp_path / "file"
    file.write_text("not a directory")
    toml_path = tmp_path / "run.toml"

    def fill(text: str) -> str:
        return text.replace("<toml>", str(toml_path)).replace("<file>", str(file))

    out = [] if toml and "out_dir" in str(toml) else ["--out-dir", str(existing_run)]
    argv = ["train", *SMOKE, *out, *map(fill, flags)]
    if toml is not None:
        data = toml if isinstance(toml, bytes) else fill(toml).encode()
        toml_path.write_bytes(data)
        argv[1:1] = ["--config", str(toml_path)]
    if name.endswith("-missing"):  # an optional package that is not installed
        monkeypatch.setitem(sys.modules, name.removesuffix("-missing"), None)
    before = _files(existing_run)
    capsys.readouterr()
    assert main(argv) == 2
    assert capsys.readouterr().err == f"isotrain train: error: {fill(expected)}\n"
    assert _files(existing_run) == before


def _safetensors(tmp_path: Path) -> dict[str, Path]:
    import safetensors.torch as st
    import torch

    foreign = tmp_path / "foreign.safetensors"
    st.save_file({"w": torch.zeros(3)}, str(foreign))
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(foreign.read_bytes()[:-5])
    return {"foreign": foreign, "truncated": truncated}


OTHER_CASES = [
    ("sample-no-run", ["sample"],
     "isotrain sample: error: which run? try isotrain sample runs/default"),
    ("report-two-runs", ["report", "<run>", "--run", "<dir>"],
     "isotrain report: error: two runs given (<run>, --run <dir>); try just RUN"),
    ("sample-temperature-negative", ["sample", "<run>", "--temperature", "-1"],
     "isotrain sample: error: --temperature -1.0 is invalid: use a finite number >= 0 "
     "(0 picks the most likely token); try --temperature 0.7"),
    ("sample-temperature-nan", ["sample", "<run>", "--temperature", "nan"],
     "isotrain sample: error: --temperature nan is invalid: use a finite number >= 0 "
     "(0 picks the most likely token); try --temperature 0.7"),
    ("sample-top-k-zero", ["sample", "<run>", "--top-k", "0"],
     "isotrain sample: error: --top-k 0 is invalid: use 1 or more, or None (all); "
     "try --top-k 50"),
    ("sample-top-p", ["sample", "<run>", "--top-p", "1.5"],
     "isotrain sample: error: --top-p 1.5 is invalid: use a probability in (0, 1], or None "
     "(off); try --top-p 0.9"),
    ("sample-tokens-text", ["sample", "<run>", "--tokens", "many"],
     "isotrain sample: error: --tokens many is not an integer; try --tokens 200"),
    ("sample-prompt-file", ["sample", "<run>", "--prompt-file", "<dir>/none.txt"],
     "isotrain sample: error: --prompt-file <dir>/none.txt: no such file"),
    ("export-safetensors-missing", ["export", "<run>", "--out", "<dir>/m.safetensors"],
     f"isotrain export: error: export needs safetensors; try {install_hint('export')}"),
    ("prepare-no-input", ["prepare", "--out", "<dir>/p"],
     "isotrain prepare: error: --input is required; try isotrain prepare --input INPUT ..."),
    ("prepare-nothing", ["prepare"],
     "isotrain prepare: error: --input and --out are required; "
     "try isotrain prepare --input INPUT ... --out OUT"),
    ("prepare-tokenizers-missing",
     ["prepare", "--input", "<file>", "--out", "<dir>/p", "--tokenizer", "bpe"],
     "isotrain prepare: error: BPE and tokenizer.json files need Hugging Face tokenizers; "
     f"try {install_hint('data')}"),
    ("export-onto-a-directory", ["export", "--run", "<run>", "--out", "<dir>"],
     "isotrain export: error: --out <dir> is a directory; try another --out"),
    ("export-under-a-file", ["export", "--run", "<run>", "--out", "<file>/m.safetensors"],
     "isotrain export: error: --out <file>/m.safetensors lies under the file <file>; "
     "try another --out"),
    ("export-which", ["export", "--run", "<run>", "--which", "worst"],
     "isotrain export: error: --which worst is not one of latest, best; try --which latest"),
    ("plot-onto-a-file", ["plot", "--run", "<run>", "--out", "<file>"],
     "isotrain plot: error: --out <file> is a file; try another --out"),
    ("plot-without-matplotlib", ["plot", "--run", "<run>", "--out", "<dir>"],
     "isotrain plot: error: plots need matplotlib, which is not installed; "
     f"try {install_hint('plots')}"),
    ("report-not-a-run", ["report", "--run", "<dir>"],
     "isotrain report: error: <dir>/metrics.jsonl: no metrics file; try the --out-dir of an "
     "isotrain train run"),
    ("sample-not-a-run", ["sample", "--run", "<dir>"],
     "isotrain sample: error: <dir>: no snapshot found (looked in <dir>/snapshots); try the "
     "--out-dir of a run"),
    ("sample-truncated-export", ["sample", "--run", "<truncated>"],
     "isotrain sample: error: <truncated>: not a readable safetensors file: tensor 'w' lies at "
     "bytes 0..12, outside the data (7 bytes); try a file written by isotrain export or "
     "save_pretrained(..., safe_serialization=True)"),
    ("sample-foreign-export", ["sample", "--run", "<foreign>"],
     "isotrain sample: error: <foreign>: not an isotrain export (no isotrain_model_config "
     "metadata); try a file written by isotrain export"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "argv", "expected"), OTHER_CASES, ids=[c[0] for c in OTHER_CASES])
def test_bad_paths_and_files_of_the_other_commands_are_one_line(
    existing_run, tmp_path, monkeypatch, capsys, name, argv, expected
) -> None:
    paths = {"run": existing_run, "dir": tmp_path / "dir", "file": tmp_path / "file"}
    paths.update(_safetensors(tmp_path))
    paths["dir"].mkdir()
    paths["file"].write_text("not a directory")

    def fill(text: str) -> str:
        for key, path in paths.items():
            text = text.replace(f"<{key}>", str(path))
        return text

    if name == "plot-without-matplotlib":
        monkeypatch.setitem(sys.modules, "matplotlib", None)
    if name.endswith("-missing"):  # an optional package that is not installed
        monkeypatch.setitem(sys.modules, name.split("-")[-2], None)
    before = _files(existing_run)
    capsys.readouterr()
    assert main([fill(a) for a in argv]) == 2
    assert capsys.readouterr().err == fill(expected) + "\n"
    assert _files(existing_run) == before


def test_a_torchrun_worker_other_than_rank_0_leaves_the_message_to_rank_0(
    monkeypatch, capsys
) -> None:
    line = "isotrain train: error: --steps x is not an integer; try --steps 1000\n"
    for rank, said in (("1", ""), ("0", line)):
        monkeypatch.setenv("RANK", rank)
        assert main(["train", "--steps", "x"]) == 2
        assert capsys.readouterr().err == said


def test_the_install_hint_is_the_command_this_environment_needs(tmp_path, monkeypatch) -> None:
    root = Path(__file__).resolve().parents[2]
    pip = Path(sys.executable).with_name("pip")
    if not (root / "pyproject.toml").is_file() or not pip.is_file():
        pytest.skip("isotrain is not run from a source checkout with pip beside python")
    monkeypatch.setenv("PATH", str(tmp_path))  # no pip on the PATH: name the venv's own
    monkeypatch.chdir(root)
    assert (
        install_hint("data") == f"{pip.relative_to(root) if pip.is_relative_to(root) else pip}"
        " install -e '.[data]'"
    )
    monkeypatch.chdir(tmp_path)
    assert install_hint("data").endswith(f" install -e '{root}[data]'")
