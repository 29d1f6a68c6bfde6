"""Training on your own data and weights, end to end: BPE runs, prepared and nanoGPT folders,
fine-tuning from a run, an exported file and a GPT-2 folder saved by transformers."""

import dataclasses
import json
import random
import shutil

import numpy as np
import pytest
import torch

from isotrain.train import config as C
from isotrain.train.cli.main import main
from isotrain.train.data.tokenizer import HFTokenizer, text_chunks
from isotrain.train.loop import setup, train
from isotrain.train.rundir.metrics import read_metrics
from isotrain.train.weights.load import load_model

SMOKE = ["--preset", "smoke", "--data.max-bytes", "60000"]
LINES = [f"def f{i}(x):  # é {i}\n    return x * {i} + {i % 7}\n\n" for i in range(900)]


def _cfg(out, **kw) -> C.TrainConfig:
    base = C.PRESETS["smoke"]()
    data = dataclasses.replace(base.data, max_bytes=60_000, path=kw.pop("path", None))
    return dataclasses.replace(base, data=data, out_dir=str(out), sample_tokens=0, **kw)


def _summary(run) -> dict:
    return read_metrics(run)[-1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("own")
    src = root / "src"
    src.mkdir()
    for i in range(4):
        (src / f"{i}.py").write_text("".join(LINES[i::4]))
    return root


@pytest.mark.slow
def test_bpe_run_end_to_end(corpus, tmp_path, capsys) -> None:
    transformers = pytest.importorskip("transformers")
    data, run = tmp_path / "data", tmp_path / "run"
    prep = ["prepare", "--input", str(corpus / "src"), "--out", str(data), "--no-progress"]
    assert main([*prep, "--tokenizer", "bpe", "--vocab-size", "320", "--val-fraction", "0.25"]) == 0
    args = [*SMOKE, "--data.path", str(data), "--model.vocab-size", "320", "--out-dir", str(run)]
    assert main(["train", *args, "--steps", "4", "--sample-tokens", "12"]) == 0  # sample decodes
    tok = HFTokenizer.from_file(data / "tokenizer.json")
    assert HFTokenizer.from_file(run / "tokenizer.json").sha256 == tok.sha256
    assert main(["train", *args, "--steps", "6"]) == 0  # resumes with the run's tokenizer
    records = read_metrics(run)
    assert records[0]["config"]["tokenizer_sha256"] == tok.sha256
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [4, 6]
    meta = json.loads((data / "meta.json").read_text())
    ratio = meta["splits"]["val"]["tokens"] / meta["splits"]["val"]["bytes"]
    for r in evals:  # per token and in bits per byte, the baseline in the same units
        assert r["val_bpb"] == pytest.approx(r["val_loss"] * ratio / np.log(2))
        assert r["unigram_baseline_bpb"] == pytest.approx(r["unigram_baseline"] * ratio / np.log(2))
    capsys.readouterr()
    assert main(["sample", "--run", str(run), "--prompt", "def f", "--tokens", "8"]) == 0
    from_run = capsys.readouterr().out
    assert from_run.startswith("def f")
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "m.safetensors")]) == 0
    capsys.readouterr()
    sample = ["sample", "--run", str(tmp_path / "m.safetensors"), "--prompt", "def f"]
    assert main([*sample, "--tokens", "8"]) == 0
    assert capsys.readouterr().out == from_run  # the export carries the tokenizer
    assert main(["export", "--run", str(run), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ids = auto("def f12(x):")["input_ids"]
    assert ids == tok.encode("def f12(x):")
    with torch.no_grad():
        diff = load_model(str(run)).eval()(torch.tensor([ids])) - hf(torch.tensor([ids])).logits
    assert diff.abs().max().item() < 1e-5


def test_bpe_trained_on_text_and_kept_on_resume(corpus, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    args = [*SMOKE, "--data.path", str(corpus / "src"), "--out-dir", str(run), "--steps", "2"]
    assert main(["train", *args, "--tokenizer", "bpe", "--model.vocab-size", "300"]) == 0
    sha = HFTokenizer.from_file(run / "tokenizer.json").sha256
    assert (
        _summary(run)["val_bpb"] > 0 and read_metrics(run)[0]["config"]["tokenizer_sha256"] == sha
    )
    code = main(["train", *args, "--model.vocab-size", "300", "--tokenizer", "bytes"])
    err = capsys.readouterr().err
    assert code == 2 and f"cannot resume {run}: it trained with {run}/tokenizer.json" in err
    assert "; drop --tokenizer bytes to continue it, or try a new --out-dir" in err
    code = main(["train", *args, "--model.vocab-size", "300", "--init-from", str(run)])
    err = capsys.readouterr().err  # no --tokenizer given: none to drop, no --steps to guess
    assert code == 2 and "--tokenizer" not in err.split(";", 1)[1] and "--steps" not in err


def test_nanogpt_folder_of_unknown_ids(tmp_path, capsys) -> None:
    ids = np.random.default_rng(0).integers(0, 500, size=4000).astype(np.uint16)
    ids[:3600].tofile(tmp_path / "train.bin")
    ids[3600:].tofile(tmp_path / "val.bin")
    args = [*SMOKE, "--data.path", str(tmp_path), "--model.vocab-size", "500", "--steps", "2"]
    assert main(["train", *args, "--out-dir", str(tmp_path / "a")]) == 2
    assert "holds token ids but no meta.json naming their tokenizer" in capsys.readouterr().err
    run = tmp_path / "b"
    assert main(["train", *args, "--tokenizer", "ids", "--out-dir", str(run)]) == 0
    assert "val_bpb" not in _summary(run)  # no text behind the ids: per token only
    capsys.readouterr()
    assert main(["sample", "--run", str(run), "--prompt", "1 2 3", "--tokens", "4"]) == 0
    assert len(capsys.readouterr().out.split()) == 7


def test_tokenized_npy_with_its_tokenizer_file(corpus, tmp_path) -> None:
    """The reported crash: BPE ids saved as .npy, trained, then sampled at the end."""
    text = "".join(LINES)
    tok = HFTokenizer.train_bpe(text_chunks(text), 400)
    tok.save(tmp_path / "tok.json")
    np.save(tmp_path / "ids.npy", np.asarray(tok.encode(text), dtype=np.uint16))
    cfg = _cfg(
        tmp_path / "run", path=str(tmp_path / "ids.npy"), tokenizer=str(tmp_path / "tok.json")
    )
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=400))
    train(dataclasses.replace(cfg, steps=2, sample_tokens=8))
    assert _summary(tmp_path / "run")["val_bpb"] > 0


@pytest.fixture(scope="module")
def source_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("ft") / "src"
    train(_cfg(run, steps=40, eval_every=40))
    return run


def _new_text(path) -> str:
    rng = random.Random(0)
    words = ["αβγ", "δέλτα", "жизнь", "слово", "ψυχή", "мир", "λόγος", "дом"]
    path.write_text("\n".join(" ".join(rng.choices(words, k=12)) for _ in range(2000)))
    return str(path)


def _assert_fresh_start(cfg, weights) -> None:
    run = setup(cfg)
    assert run.state.step == 0 and not run.optimizer.state
    assert int(run.updater.guard.state_dict()["spikes"]["count"]) == 0
    for name, t in weights.state_dict().items():
        assert torch.equal(run.model.state_dict()[name], t), name


@pytest.mark.slow
def test_fine_tune_from_a_run_starts_fresh_and_skips_nothing(source_run, tmp_path) -> None:
    new = _new_text(tmp_path / "new.txt")
    source = load_model(str(source_run))
    cfg = _cfg(tmp_path / "ft", path=new, init_from=str(source_run), steps=24, eval_every=100)
    _assert_fresh_start(cfg, source)
    train(cfg)
    assert _summary(tmp_path / "ft")["skipped_steps"] == 0
    # The old workaround, resuming a copy of the run on the new data, continued the old
    # optimizer, schedule and guard window (whose old gradient norms made the new data's first
    # steps look like spikes). It is refused now, naming --init-from.
    shutil.copytree(source_run, tmp_path / "copy")
    refused = r"holds a run with --data.path None, not .*--init-from"
    with pytest.raises(C.ConfigError, match=refused):
        train(_cfg(tmp_path / "copy", path=new, steps=64, eval_every=100))


def test_fine_tune_from_an_exported_file(source_run, tmp_path, capsys) -> None:
    out = tmp_path / "m.safetensors"
    assert main(["export", "--run", str(source_run), "--out", str(out)]) == 0
    _assert_fresh_start(_cfg(tmp_path / "ft", init_from=str(out)), load_model(str(out)))
    code = main(["train", *SMOKE, "--resume", str(out), "--out-dir", str(tmp_path / "x")])
    assert code == 2 and f"pass --init-from {out}" in capsys.readouterr().err


def test_init_from_warns_only_about_the_shape_flags_it_overrides(tmp_path, caplog) -> None:
    """A shape flag the user passed and the weights override is a warning; a value the user
    never passed (a default, a preset's) is information, naming where it came from."""
    from isotrain.train.model.gpt import GPT, GPTConfig
    from isotrain.train.weights.export import export_safetensors

    torch.manual_seed(0)
    shape = GPTConfig(n_layer=1, n_head=2, d_model=32, block_size=16, gelu="tanh")
    init = export_safetensors(GPT(shape), tmp_path / "init.safetensors")
    argv = ["train", *SMOKE, "--init-from", str(init), "--model.n-layer", "3", "--steps", "1"]
    argv += ["--sample-tokens", "0", "--no-progress", "--out-dir", str(tmp_path / "ft")]
    with caplog.at_level("INFO", logger="isotrain.train.inputs"):
        assert main(argv) == 0
    shaped = [(r.levelname, r.getMessage()) for r in caplog.records if "model shape" in r.msg]
    assert shaped == [
        ("WARNING", f"--init-from {init} overrides the model shape you passed: "
                    "--model.n-layer 1 (you passed 3)"),
        ("INFO", f"--init-from {init} sets the model shape: --model.block-size 16 "
                 "(--preset smoke: 32), --model.gelu 'tanh' (default: 'exact')"),
    ]  # fmt: skip


def test_fine_tune_a_gpt2_saved_by_transformers(corpus, tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=320, n_positions=32, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(str(tmp_path / "gpt2"))
    bpe = HFTokenizer.train_bpe(text_chunks("".join(LINES)), 320)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe.tok)
    fast.save_pretrained(str(tmp_path / "gpt2"))
    spec = f"hf:{tmp_path / 'gpt2'}"
    cfg = _cfg(tmp_path / "ft", path=str(corpus / "src"), init_from=spec, steps=2)
    _assert_fresh_start(cfg, load_model(spec))
    train(cfg)  # shape (vocab 320, tanh GELU) and tokenizer come from the folder
    first = read_metrics(tmp_path / "ft")[0]["config"]
    assert first["model"]["gelu"] == "tanh" and first["model"]["vocab_size"] == 320
    saved = HFTokenizer.from_file(tmp_path / "gpt2" / "tokenizer.json")
    assert first["tokenizer_sha256"] == saved.sha256
    assert saved.encode(LINES[5]) == bpe.encode(LINES[5])
    data = tmp_path / "bytes_data"
    assert (
        main(["prepare", "--input", str(corpus / "src"), "--out", str(data), "--no-progress"]) == 0
    )
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(data)))
    with pytest.raises(
        C.ConfigError,
        match=r"--data.path .*bytes_data was made with bytes .*, but the run's tokenizer is "
        r".*gpt2/tokenizer.json",
    ):
        setup(dataclasses.replace(cfg, out_dir=str(tmp_path / "ft2")))


def test_the_vocabulary_size_comes_from_the_tokenizer(corpus, tmp_path, capsys, caplog) -> None:
    from isotrain.train.inputs import load_inputs

    data = tmp_path / "data"
    prep = ["prepare", "--input", str(corpus / "src"), "--out", str(data), "--no-progress"]
    assert main([*prep, "--tokenizer", "bpe", "--vocab-size", "320"]) == 0
    tokenizer = str(data / "tokenizer.json")

    def vocab(out: str, **kw) -> int:
        return load_inputs(_cfg(tmp_path / out, **kw))[0].model.vocab_size

    with caplog.at_level("INFO"):
        assert vocab("a", path=str(data)) == 320  # a prepared folder's meta.json
        assert vocab("b", path=str(corpus / "src"), tokenizer=tokenizer) == 320
    assert "--model.vocab-size 320: the size of" in caplog.text
    caplog.clear()

    def given(size: int, out: str) -> C.TrainConfig:
        cfg = _cfg(tmp_path / out, path=str(corpus / "src"), tokenizer=tokenizer)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=size))
        return load_inputs(cfg)[0]

    assert given(384, "c").model.vocab_size == 384 and not caplog.text  # padded to 128: fine
    assert given(1600, "d").model.vocab_size == 1600
    assert "--model.vocab-size 1600 is larger than" in caplog.text
    assert "(320): 1280 embedding rows (40,960 parameters) are never used" in caplog.text
    with pytest.raises(C.ConfigError) as info:
        given(300, "e")
    assert str(info.value).startswith("--model.vocab-size 300 is too small for ")
    assert str(info.value).endswith(
        "; pass --model.vocab-size 320, or leave it out to take the tokenizer's"
    )
