"""Weights from outside a run are untrusted input: every malformed `.safetensors` export and
Hugging Face folder below is made here and fed to every command that reads it (`sample FILE`,
`train --init-from FILE`, `sample hf:FOLDER`, `train --init-from hf:FOLDER`, `sample
FOLDER/model.safetensors`). Each must end in one line naming the file and what is wrong, exit
2, no traceback, no model built (a GPT off the meta device is recorded) and no Python
allocation beyond the file's own size, and leave the input and an existing run untouched.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from isotrain.train.cli.main import main
from isotrain.train.model.gpt import GPT, GPTConfig
from isotrain.train.weights.export import export_hf, export_safetensors

SMOKE = ["--preset", "smoke", "--data.max-bytes", "60000", "--sample-tokens", "0"]
ST_FIX = "try a file written by isotrain export or save_pretrained(..., safe_serialization=True)"
HF_FIX = "fix it, or save the model again with save_pretrained(folder, safe_serialization=True)"
SAME = "is the config the one these weights were saved with?"
# Python-level bytes the loader may take besides the file's: the parsed header and the meta
# model it checks shapes on (about 90 kB for one block), whatever size the config asks for
SLACK = 128 << 10


def _hashes(root: Path) -> dict[str, str | None]:
    """Every path under `root` with the sha256 of its bytes (None for a directory)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        if p.is_file()
        else None
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """A good export, a good HF folder of the same tiny GPT, and an existing trained run."""
    root = tmp_path_factory.mktemp("weights")
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, block_size=16))
    run = root / "run"
    assert main(["train", *SMOKE, "--steps", "2", "--out-dir", str(run)]) == 0
    return {
        "export": export_safetensors(model, root / "good.safetensors"),
        "hf": export_hf(model, root / "hf"),
        "run": run,
    }


# ------------------------------------------------------------ making bad files from good ones
def _split(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _join(header: dict, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


def _with_config(**changes) -> Callable[[dict, bytes], bytes]:
    def make(header: dict, body: bytes) -> bytes:
        cfg = json.loads(header["__metadata__"]["isotrain_model_config"])
        header["__metadata__"]["isotrain_model_config"] = json.dumps({**cfg, **changes})
        return _join(header, body)

    return make


def _with_meta(key: str, value: str) -> Callable[[dict, bytes], bytes]:
    def make(header: dict, body: bytes) -> bytes:
        header["__metadata__"][key] = value
        return _join(header, body)

    return make


def _tensor(name: str, **changes) -> Callable[[dict, bytes], bytes]:
    def make(header: dict, body: bytes) -> bytes:
        header[name].update(changes)
        return _join(header, body)

    return make


def _raw(make: Callable[[bytes, bytes], bytes]) -> Callable[[dict, bytes], bytes]:
    """A maker of the header's raw bytes: (header JSON bytes, body) -> file."""
    return lambda header, body: make(json.dumps(header).encode(), body)


# name, file from (header, body), the message after "<file>: "
ST_CASES = [
    ("header-length-2**62", _raw(lambda h, b: struct.pack("<Q", 2**62) + h + b),
     f"not a readable safetensors file: header length 4,611,686,018,427,387,904 is past the "
     f"end of the file (<size> bytes); {ST_FIX}"),
    ("header-length-past-the-end",
     _raw(lambda h, b: struct.pack("<Q", len(h) + len(b) + 1) + h + b),
     f"not a readable safetensors file: header length <size+1-8> is past the end of the file "
     f"(<size> bytes); {ST_FIX}"),
    ("empty-file", _raw(lambda h, b: b""),
     f"not a readable safetensors file: 0 bytes, shorter than the 8-byte header length; {ST_FIX}"),
    ("bytes-after-the-last-tensor", _raw(lambda h, b: struct.pack("<Q", len(h)) + h + b + b"x"),
     f"not a readable safetensors file: 1 bytes after the last tensor; {ST_FIX}"),
    ("dtype-unknown", _tensor("ln_f.weight", dtype="F128"),
     f"not a readable safetensors file: tensor 'ln_f.weight' has dtype 'F128', which isotrain "
     f"does not read; {ST_FIX}"),
    ("weights-of-integers", _tensor("ln_f.weight", dtype="I32"),
     "tensor 'ln_f.weight' is I32; weights must be one of F16, BF16, F32, F64"),
    ("header-not-json", _raw(lambda h, b: struct.pack("<Q", len(h)) + b"{x" + h[2:] + b),
     "not a readable safetensors file: its header is not JSON (Expecting property name enclosed "
     f"in double quotes: line 1 column 2 (char 1)); {ST_FIX}"),
    ("header-a-json-list", _raw(lambda h, b: struct.pack("<Q", 2) + b"[]" + b),
     f"not a readable safetensors file: its header is a JSON list, not an object; {ST_FIX}"),
    ("offsets-past-the-end", _tensor("wpe.weight", data_offsets=[30592, 31616]),
     "not a readable safetensors file: tensor 'wpe.weight' lies at bytes 30,592..31,616, outside "
     f"the data (30,656 bytes); {ST_FIX}"),
    ("offsets-overlapping", _tensor("ln_f.weight", data_offsets=[0, 64]),
     f"not a readable safetensors file: tensor 'ln_f.weight' overlaps 'blocks.0.attn.proj.bias'; "
     f"{ST_FIX}"),
    ("size-not-dtype-times-shape", _tensor("ln_f.weight", shape=[17]),
     "not a readable safetensors file: tensor 'ln_f.weight' (F32 [17]) needs 68 bytes, not 64; "
     f"{ST_FIX}"),
    ("tensor-of-another-shape", _tensor("ln_f.weight", shape=[4, 4]),
     f"tensor 'ln_f.weight' has shape [4, 4], but the model config needs [16]; {SAME}"),
    ("config-d_model-negative", _with_config(d_model=-32),
     "<file> (isotrain_model_config): d_model -32 is invalid: it must be a positive integer; "
     "try a file written by isotrain export"),
    ("config-n_head-not-dividing", _with_config(n_head=3),
     "<file> (isotrain_model_config): d_model 16 is invalid: it must be divisible by n_head (3); "
     "try a file written by isotrain export"),
    ("config-unknown-key", _with_config(colour="red"),
     "<file> (isotrain_model_config): unknown model setting 'colour' (known: activation, bias, "
     "block_size, d_model, dropout, gelu, n_head, n_layer, positions, qk_norm, tie_head, "
     "vocab_size, zero_init); try a file written by isotrain export"),
    ("config-a-json-list", _with_meta("isotrain_model_config", "[1, 2]"),
     "<file> (isotrain_model_config): the model config is a JSON list; try a file written by "
     "isotrain export"),
    ("config-not-json", _with_meta("isotrain_model_config", "{"),
     "its isotrain_model_config metadata is not JSON (Expecting property name enclosed in "
     "double quotes: line 1 column 2 (char 1)); try a file written by isotrain export"),
    ("tokenizer-not-json", _with_meta("isotrain_tokenizer", "{not json"),
     "its isotrain_tokenizer metadata is not bytes, ids or a tokenizer's JSON (key must be a "
     "string at line 1 column 2); try a file written by isotrain export"),
    ("825-GB-of-weights", _with_config(n_layer=64, d_model=16384, n_head=16),
     f"the model config asks for 64 blocks, but the file holds 16 tensors; {SAME}"),
    ("one-block-of-d_model-16384", _with_config(d_model=16384, n_head=16),
     f"tensor 'blocks.0.attn.proj.bias' has shape [16], but the model config needs [16384]; "
     f"{SAME}"),
    ("config-vocab-other-than-the-tensors", _with_config(vocab_size=512),
     f"tensor 'lm_head.weight' has shape [256, 16], but the model config needs [512, 16]; {SAME}"),
]  # fmt: skip


def _hf_config(**changes) -> Callable[[Path], None]:
    def make(folder: Path) -> None:
        path = folder / "config.json"
        cfg = {**json.loads(path.read_text()), **changes}
        path.write_text(json.dumps({k: v for k, v in cfg.items() if v != "<drop>"}))

    return make


def _hf_text(text: str) -> Callable[[Path], None]:
    return lambda folder: (folder / "config.json").write_text(text)


def _hf_weights(folder: Path) -> None:
    """model.safetensors with wpe of another shape (a valid file otherwise)."""
    import safetensors.torch as st

    state = st.load_file(str(folder / "model.safetensors"))
    state["transformer.wpe.weight"] = torch.zeros(8, 16)
    st.save_file(state, str(folder / "model.safetensors"))


def _hf_index(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    index = {"weight_map": ["model-00001-of-00001.safetensors"]}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _hf_index_to(shard: str) -> Callable[[Path], None]:
    def make(folder: Path) -> None:
        (folder / "model.safetensors").rename(folder.parent / "model.safetensors")
        index = {"weight_map": {"transformer.wte.weight": shard}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))

    return make


def _hf_header(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 2**62) + path.read_bytes()[8:])


# name, how to spoil a copy of the good folder, the message after "<folder>"
HF_CASES = [
    ("config-without-n_embd", _hf_config(n_embd="<drop>"),
     ": config.json has no n_embd; isotrain reads GPT-2-architecture checkpoints only"),
    ("n_embd-negative", _hf_config(n_embd=-64),
     f"/config.json: n_embd -64 is invalid: it must be a positive integer; {HF_FIX}"),
    ("n_head-0", _hf_config(n_head=0),
     f"/config.json: n_head 0 is invalid: it must be a positive integer; {HF_FIX}"),
    ("n_layer-two", _hf_config(n_layer="two"),
     f'/config.json: n_layer "two" is invalid: it must be an integer; {HF_FIX}'),
    ("n_embd-null", _hf_config(n_embd=None),
     f"/config.json: n_embd null is invalid: it must be an integer; {HF_FIX}"),
    ("config-a-json-list", _hf_text("[1, 2]"),
     f"/config.json: a JSON list, not an object; {HF_FIX}"),
    ("config-not-json", _hf_text("{n_embd: 16"),
     "/config.json: not JSON (Expecting property name enclosed in double quotes: line 1 column "
     f"2 (char 1)); {HF_FIX}"),
    ("tensor-of-the-wrong-shape", _hf_weights,
     f": tensor 'transformer.wpe.weight' has shape [8, 16], but the model config needs [16, 16]; "
     f"{SAME}"),
    ("index-weight_map-a-list", _hf_index,
     f"/model.safetensors.index.json: its weight_map is not an object of tensor -> file names; "
     f"{HF_FIX}"),
    ("index-shard-outside-the-folder", _hf_index_to("../model.safetensors"),
     "/model.safetensors.index.json: shard names must be plain file names in its folder"),
    ("weights-header-length-2**62", _hf_header,
     "/model.safetensors: not a readable safetensors file: header length "
     f"4,611,686,018,427,387,904 is past the end of the file (<size> bytes); {ST_FIX}"),
    ("48-layers-of-n_embd-16384", _hf_config(n_layer=48, n_embd=16384, n_head=16),
     f": the model config asks for 48 blocks, but the file holds 16 tensors; {SAME}"),
]  # fmt: skip


@pytest.fixture
def built(monkeypatch) -> list[int]:
    """Bytes of every GPT built off the meta device while the test runs."""
    sizes: list[int] = []
    real = GPT.__init__

    def init(self, cfg):
        real(self, cfg)
        if self.wte.weight.device.type != "meta":
            sizes.append(sum(p.nbytes for p in self.parameters()))

    monkeypatch.setattr(GPT, "__init__", init)
    return sizes


@pytest.fixture
def peaks(monkeypatch) -> list[int]:
    """The peak of Python allocations inside each call of the loader every command uses
    (the CLI's own parsing, about 1.3 MB for train's flags, is not the file's doing)."""
    import isotrain.train.inputs as inputs
    import isotrain.train.weights.load as load

    out: list[int] = []
    real = load.load_with_tokenizer

    def measured(*args, **kwargs):
        tracemalloc.start()
        try:
            return real(*args, **kwargs)
        finally:
            out.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()

    monkeypatch.setattr(load, "load_with_tokenizer", measured)
    monkeypatch.setattr(inputs, "load_with_tokenizer", measured)
    return out


def _run(argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(argv)
    return code, capsys.readouterr().err


def _commands(spec: str, run: Path) -> list[tuple[list[str], str]]:
    """Each command that reads `spec`, and how its error line begins."""
    train = ["train", *SMOKE, "--init-from", spec, "--out-dir", str(run)]
    return [
        (["sample", spec, "--tokens", "2"], "isotrain sample: error: "),
        (train, "isotrain train: error: --init-from "),
    ]


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in [path, *path.rglob("*")] if p.is_file())


def _check_refused(case: Path, specs: list[str], made, expected: str, built, peaks, capsys) -> None:
    size = _size(case)
    before, run_before = _hashes(case.parent), _hashes(made["run"])
    for spec in specs:
        for argv, head in _commands(spec, made["run"]):
            assert _run(argv, capsys) == (2, f"{head}{expected}\n"), argv
            assert built == [], f"{argv}: a model was built before the file was checked"
            assert len(peaks) == 1 and peaks.pop() < size + SLACK, f"{argv}: {peaks}, {size:,}"
    assert _hashes(case.parent) == before and _hashes(made["run"]) == run_before


@pytest.mark.parametrize(("name", "make", "expected"), ST_CASES, ids=[c[0] for c in ST_CASES])
def test_a_malformed_export_is_one_line_everywhere(
    made, tmp_path, built, peaks, capsys, name, make, expected
) -> None:
    header, body = _split(made["export"])
    case = tmp_path / "case" / f"{name}.safetensors"
    case.parent.mkdir()
    case.write_bytes(make(header, body))
    size = case.stat().st_size
    for key, value in {
        "<file>": case,
        "<size+1-8>": f"{size - 7:,}",
        "<size>": f"{size:,}",
    }.items():
        expected = expected.replace(key, str(value))
    if not expected.startswith(str(case)):
        expected = f"{case}: {expected}"
    _check_refused(case, [str(case)], made, expected, built, peaks, capsys)


@pytest.mark.parametrize(("name", "spoil", "expected"), HF_CASES, ids=[c[0] for c in HF_CASES])
def test_a_malformed_hf_folder_is_one_line_everywhere(
    made, tmp_path, built, peaks, capsys, name, spoil, expected
) -> None:
    folder = tmp_path / "case" / "hf"
    shutil.copytree(made["hf"], folder)
    spoil(folder)
    weights = folder / "model.safetensors"
    if weights.is_file():
        expected = expected.replace("<size>", f"{weights.stat().st_size:,}")
    specs = [f"hf:{folder}"] + ([str(weights)] if weights.is_file() else [])
    _check_refused(folder, specs, made, f"{folder}{expected}", built, peaks, capsys)


def test_the_good_files_load_and_the_checks_above_can_see_a_model_built(
    made, built, peaks, capsys
) -> None:
    """The reference the refusals are measured against: the same commands on the good files
    build one model each, within the bounds above."""
    for spec, where in [(str(made["export"]), made["export"]), (f"hf:{made['hf']}", made["hf"])]:
        code, err = _run(["sample", spec, "--tokens", "2"], capsys)
        assert code == 0, err
        assert len(built) == 1 and 0 < built.pop() <= _size(where)
        assert len(peaks) == 1 and peaks.pop() < _size(where) + SLACK


@pytest.mark.parametrize("kind", ["export", "hf"])
def test_a_file_cut_short_after_its_check_is_still_one_line(
    made, tmp_path, monkeypatch, capsys, kind
) -> None:
    """Between isotrain's check and the library's read the file is cut short (another
    process rewriting it): what the library finds then is one line as well."""
    import isotrain.train.weights.hf_folder as hf_folder
    import isotrain.train.weights.load as load

    target = tmp_path / ("hf" if kind == "hf" else "m.safetensors")
    weights = target / "model.safetensors" if kind == "hf" else target
    module = hf_folder if kind == "hf" else load
    real = module.read_header

    def read_then_cut(path):
        header = real(path)
        Path(path).write_bytes(Path(path).read_bytes()[:-100])
        return header

    monkeypatch.setattr(module, "read_header", read_then_cut)
    expected = (
        f"{weights}: not a readable safetensors file: Error while deserializing header: "
        f"incomplete metadata, file not fully covered (did it change while it was read?); "
        f"{ST_FIX}\n"
    )
    for argv, head in _commands(f"hf:{target}" if kind == "hf" else str(target), made["run"]):
        if kind == "hf":  # a fresh copy for each command: the last one was cut
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(made["hf"], target)
        else:
            shutil.copy(made["export"], target)
        assert _run(argv, capsys) == (2, head + expected), argv
