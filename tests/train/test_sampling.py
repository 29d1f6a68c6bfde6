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
