"""Hugging Face both ways: isotrain -> GPT2LMHeadModel / AutoTokenizer, and GPT-2 -> isotrain.

transformers is imported once for the module; every model is tiny and random (no download).
"""

import json
import os
import stat

import pytest
import torch

transformers = pytest.importorskip("transformers")

from isotrain.train.cli.main import main  # noqa: E402
from isotrain.train.data.sources import DataError  # noqa: E402
from isotrain.train.data.tokenizer import HFTokenizer, text_chunks  # noqa: E402
from isotrain.train.model.gpt import GPT, GPTConfig  # noqa: E402
from isotrain.train.weights.export import export_hf  # noqa: E402
from isotrain.train.weights.hf_folder import read_hf_folder  # noqa: E402
from isotrain.train.weights.load import read_safetensors  # noqa: E402

TEXT = "def f(x):\n    return x + 1  # é ✓\n\nclass A:\n    pass\n" * 30


def _tiny(**kw) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, block_size=32, vocab_size=300, **kw))
    with torch.no_grad():  # nonzero biases and norms, so a wrong map cannot pass by luck
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _hf_logits(folder, idx: torch.Tensor) -> torch.Tensor:
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        return hf(idx).logits


@pytest.mark.parametrize("kw", [{}, {"gelu": "tanh"}, {"bias": False}])
def test_export_loads_in_transformers_with_equal_logits(tmp_path, kw) -> None:
    model = _tiny(**kw)
    export_hf(model, tmp_path / "hf")
    idx = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(idx)
    theirs = _hf_logits(tmp_path / "hf", idx)
    assert (ours - theirs).abs().max().item() < 1e-5
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["activation_function"] == ("gelu_new" if kw.get("gelu") else "gelu")


def test_exported_files_have_ordinary_permissions(tmp_path) -> None:
    export_hf(_tiny(), tmp_path / "hf")
    mask = os.umask(0)
    os.umask(mask)
    for f in (tmp_path / "hf").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~mask, f.name


def test_export_writes_a_tokenizer_autotokenizer_reads(tmp_path) -> None:
    tok = HFTokenizer.train_bpe(text_chunks(TEXT), 300)
    export_hf(_tiny(), tmp_path / "bpe", tok)
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "bpe"))
    sample = "def g(y):  # ✓ ünïcode\n"
    assert auto(sample)["input_ids"] == tok.encode(sample)
    assert auto.decode(tok.encode(sample)) == sample
    export_hf(GPT(GPTConfig(n_layer=1, n_head=1, d_model=8, block_size=8)), tmp_path / "bytes")
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "bytes"))
    assert auto(sample)["input_ids"] == list(sample.encode())


def _saved_gpt2(folder, *, activation="gelu_new", with_tokenizer=True):
    config = transformers.GPT2Config(
        vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=2,
        activation_function=activation, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(str(folder))
    if with_tokenizer:
        bpe = HFTokenizer.train_bpe(text_chunks(TEXT), 300)
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe.tok)
        fast.save_pretrained(str(folder))
    return model


def test_gpt2_saved_by_transformers_reads_back_with_equal_logits(tmp_path) -> None:
    hf = _saved_gpt2(tmp_path)
    ours, tok = read_hf_folder(tmp_path)
    assert ours.cfg.gelu == "tanh" and ours.cfg.vocab_size == 300 and ours.cfg.block_size == 32
    idx = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (ours.eval()(idx) - hf(idx).logits).abs().max().item()
    assert diff < 1e-5
    assert tok is not None and tok.encode(TEXT[:50]) == HFTokenizer.train_bpe(
        text_chunks(TEXT), 300
    ).encode(TEXT[:50])


def test_round_trip_isotrain_hf_isotrain_is_exact(tmp_path) -> None:
    model = _tiny()
    export_hf(model, tmp_path / "hf")
    back, _ = read_hf_folder(tmp_path / "hf")
    for (name, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name


def test_unsupported_gpt2_settings_are_refused_by_name(tmp_path) -> None:
    _saved_gpt2(tmp_path, activation="relu", with_tokenizer=False)
    with pytest.raises(DataError, match="unsupported settings: activation_function 'relu'"):
        read_hf_folder(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "config.json").write_text(
        (tmp_path / "config.json").read_text().replace('"relu"', '"gelu"')
    )
    with pytest.raises(FileNotFoundError, match="isotrain reads safetensors only"):
        read_hf_folder(tmp_path)


def test_sample_and_load_from_an_hf_folder(tmp_path, capsys) -> None:
    tok = HFTokenizer.train_bpe(text_chunks(TEXT), 300)
    model = _tiny()
    export_hf(model, tmp_path / "hf", tok)
    again, tok_again = read_safetensors(tmp_path / "hf" / "model.safetensors")  # config.json beside
    assert torch.equal(again.wte.weight, model.wte.weight) and tok_again.sha256 == tok.sha256
    args = ["sample", "--run", f"hf:{tmp_path / 'hf'}", "--prompt", "def f", "--tokens", "5"]
    assert main([*args, "--temperature", "0"]) == 0
    ids = model.generate(torch.tensor([tok.encode("def f")]), 5, temperature=0.0)
    assert (
        capsys.readouterr().out == "def f" + tok.decode(ids[0, len(tok.encode("def f")) :]) + "\n"
    )
