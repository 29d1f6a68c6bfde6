"""Sampling through the run's tokenizer: top-k / top-p filters, several samples, a prompt file,
and one-line errors for values that cannot work."""

import pytest
import torch

from isotrain.train.cli.main import main
from isotrain.train.model.gpt import GPT, GPTConfig, _filter
from isotrain.train.model.sampling import samples
from isotrain.train.weights.export import export_safetensors


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])  # probabilities 0.03, 0.64, 0.09, 0.24
    probs = logits.softmax(-1)[0]
    kept = lambda p: torch.isfinite(_filter(logits, None, p))[0].tolist()  # noqa: E731
    top2 = float(probs[1] + probs[3])
    assert kept(top2 - 1e-4) == [False, True, False, True]  # 0.64 + 0.24 reaches p
    assert kept(top2 + 1e-4) == [False, True, True, True]
    assert kept(0.5) == [False, True, False, False]  # the most likely token always stays
    assert kept(1.0) == [True] * 4
    both = torch.isfinite(_filter(logits, 1, 0.9))[0].tolist()
    assert both == [False, True, False, False]  # top-k first, then the nucleus


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, block_size=16))
    return export_safetensors(model, tmp_path_factory.mktemp("s") / "m.safetensors"), model


def test_several_samples_from_a_prompt_file(model_file, tmp_path, capsys) -> None:
    path, model = model_file
    (tmp_path / "p.txt").write_text("héllo\n", encoding="utf-8")
    args = ["sample", "--run", str(path), "--prompt-file", str(tmp_path / "p.txt")]
    assert main([*args, "--tokens", "6", "--num-samples", "3", "--top-p", "0.9"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- sample ") == 3 and out.count("héllo\n") == 3
    texts = samples(model, "héllo\n", 6, top_p=0.9, num_samples=3)
    assert out == "".join(f"--- sample {i + 1} of 3 ---\nhéllo\n{t}\n" for i, t in enumerate(texts))
    assert len(set(texts)) > 1  # each row draws its own tokens


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--temperature", "-1", "--temperature -1.0 is invalid: use a finite number >= 0"),
        ("--temperature", "nan", "--temperature nan is invalid"),
        ("--top-k", "0", "--top-k 0 is invalid: use 1 or more, or None (all); try --top-k 50"),
        ("--tokens", "-1", "--tokens -1 is invalid: use 0 or more; try --tokens 200"),
        ("--top-p", "1.5", "--top-p 1.5 is invalid: use a probability in (0, 1], or None (off)"),
        ("--num-samples", "0", "--num-samples 0 is invalid: use 1 or more; try --num-samples 3"),
        ("--max-whitespace", "-1", "--max-whitespace -1 is invalid: use 0 (off) or more"),
    ],
)
def test_bad_sampling_values_are_one_line_errors(model_file, capsys, flag, value, message) -> None:
    code = main(["sample", "--run", str(model_file[0]), flag, value])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("isotrain sample: error: ") and message in err and "try" in err


def test_the_end_of_run_prompt_is_whole_lines_of_the_validation_data() -> None:
    import numpy as np

    from isotrain.train.data.tokenizer import ByteTokenizer
    from isotrain.train.model.sampling import prompt_from

    text = "".join(f"line {i}: value = {i * i}\n" for i in range(200))
    val = np.frombuffer(text.encode(), dtype=np.uint8).astype(np.uint16)
    tok = ByteTokenizer()
    a = prompt_from(val, tok, seed=3)
    assert a == prompt_from(val, tok, seed=3) != prompt_from(val, tok, seed=4)
    assert a.endswith("\n") and a.startswith("line ") and a in text
    assert all(line in text.splitlines() for line in a.splitlines())


def _space_lover(block_size: int = 16) -> GPT:
    """A GPT whose every next byte is a space, else "x": the run of spaces a small model can
    fall into at a low temperature, made certain (NOTE [whitespace runs])."""
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, block_size=block_size))
    with torch.no_grad():
        model.ln_f.weight.zero_()  # logits = ln_f.bias @ wte.T, whatever the input
        model.ln_f.bias.copy_(torch.eye(16)[0])
        model.wte.weight.zero_()
        model.wte.weight[32, 0], model.wte.weight[ord("x"), 0] = 10.0, 5.0  # " " first, "x" next
    return model


def test_a_whitespace_run_stops_at_max_whitespace_and_the_budget_goes_on_text() -> None:
    model = _space_lover()
    greedy = {"temperature": 0.0}
    assert samples(model, "a", 12, max_whitespace=0, **greedy) == [" " * 12]  # the old way
    assert samples(model, "a", 12, max_whitespace=4, **greedy) == ["    x    x  "]
    assert samples(model, "a  ", 12, max_whitespace=4, **greedy) == ["  x    x    "]  # the prompt's
    drawn = samples(model, "a", 200, temperature=0.7, top_p=0.5, max_whitespace=4)[0]
    assert drawn == "    x" * 40  # block_size 16: the context is all spaces long before 200
    assert samples(model, "a", 40)[0] == " " * 40  # the default, 64: a run shorter is untouched


def test_whitespace_counts_characters_of_multi_space_tokens() -> None:
    from isotrain.train.data.tokenizer import HFTokenizer, text_chunks
    from isotrain.train.model.sampling import whitespace_chars

    tok = HFTokenizer.train_bpe(text_chunks("def f(x):\n        return x\n" * 200), 300)
    chars = whitespace_chars(tok, 320, torch.device("cpu")).tolist()
    for i in range(320):
        text = tok.decode([i]) if i < tok.vocab_size else ""
        assert chars[i] == (len(text) if text.isspace() else 0), (i, text)
    assert max(chars) >= 8  # a token of eight spaces counts eight


def test_isotrain_sample_says_when_a_run_of_whitespace_was_stopped(tmp_path, capsys) -> None:
    path = export_safetensors(_space_lover(), tmp_path / "spaces.safetensors")
    args = ["sample", str(path), "--prompt", "a", "--tokens", "70", "--num-samples", "2"]
    assert main([*args, "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    line = "a" + " " * 64 + "x\n"  # then 5 spaces, left out as trailing
    assert out == f"--- sample 1 of 2 ---\n{line}--- sample 2 of 2 ---\n{line}"
    assert err.splitlines()[-1] == (
        "(a run of 64 whitespace characters was stopped in sample 1, 2; --max-whitespace 0 lets "
        "it go on)"
    )
    assert main([*args, "--temperature", "0", "--max-whitespace", "0", "--raw"]) == 0
    out, err = capsys.readouterr()
    assert out.count("a" + " " * 70 + "\n") == 2 and err == ""


def test_the_cli_default_is_the_samplers() -> None:
    from isotrain.train.cli.commands import SampleArgs
    from isotrain.train.model.sampling import MAX_WHITESPACE

    assert SampleArgs().max_whitespace == MAX_WHITESPACE
