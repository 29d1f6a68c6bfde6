"""Tokenizers: bytes, locally trained byte-level BPE, tokenizer.json files; bits per byte."""

import math

import numpy as np
import pytest

from isotrain.train.data import batches as D
from isotrain.train.data.sources import DataError, TextData
from isotrain.train.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    IdsTokenizer,
    byte_level_json,
    run_tokenizer,
    text_chunks,
)

TEXT = (
    "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n    y: int = 0\n\n"
    "import os, sys  # héllo wörld ✓ 日本語\n"
) * 40
ODD = "héllo wörld ✓ 日本語 \x00 \U0001f600  \n\n\tx = 1 if y else None\r\n"


@pytest.fixture(scope="module")
def bpe() -> HFTokenizer:
    return HFTokenizer.train_bpe(text_chunks(TEXT), 320)


def test_bpe_is_lossless_and_has_the_asked_vocabulary(bpe: HFTokenizer) -> None:
    assert bpe.vocab_size == 320
    for text in (TEXT[:500], ODD):
        ids = bpe.encode(text)
        assert max(ids) < 320 and bpe.decode(ids) == text
    assert len(bpe.encode(TEXT)) < len(TEXT.encode()) / 2  # merges learned from the text


def test_bpe_training_is_deterministic(bpe: HFTokenizer) -> None:
    again = HFTokenizer.train_bpe(text_chunks(TEXT), 320)
    assert again.sha256 == bpe.sha256 and again.json == bpe.json
    other = HFTokenizer.train_bpe(text_chunks(TEXT), 300)
    assert other.sha256 != bpe.sha256


def test_byte_lengths_count_the_utf8_bytes_behind_each_token(bpe: HFTokenizer) -> None:
    for text in (TEXT, ODD):
        ids = np.array(bpe.encode(text))
        assert int(bpe.byte_lengths()[ids].sum()) == len(text.encode("utf-8"))
    assert np.array_equal(ByteTokenizer().byte_lengths(), np.ones(256))
    assert IdsTokenizer(10).byte_lengths() is None


def test_byte_level_json_reads_text_as_the_byte_tokenizer() -> None:
    tk = pytest.importorskip("tokenizers")
    tok = tk.Tokenizer.from_str(byte_level_json())
    ids = tok.encode(ODD, add_special_tokens=False).ids
    assert ids == ByteTokenizer().encode(ODD)
    assert tok.decode(ids) == ODD and tok.get_vocab_size() == 256


def test_tokenizer_file_round_trip_and_errors(bpe: HFTokenizer, tmp_path) -> None:
    path = bpe.save(tmp_path / "tokenizer.json")
    loaded = HFTokenizer.from_file(path)
    assert loaded.sha256 == bpe.sha256 and loaded.encode(ODD) == bpe.encode(ODD)
    (tmp_path / "bad.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(DataError, match=r"bad.json: not a tokenizer.json"):
        HFTokenizer.from_file(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError, match="no such tokenizer file"):
        HFTokenizer.from_file(tmp_path / "missing.json")


def test_run_tokenizer_refuses_a_changed_file(bpe: HFTokenizer, tmp_path) -> None:
    config = {"tokenizer": "bpe", "tokenizer_sha256": bpe.sha256, "model": {"vocab_size": 320}}
    bpe.save(tmp_path / "tokenizer.json")
    assert run_tokenizer(tmp_path, config).sha256 == bpe.sha256
    HFTokenizer.train_bpe(text_chunks(TEXT), 300).save(tmp_path / "tokenizer.json")
    with pytest.raises(DataError, match="the file was changed after training"):
        run_tokenizer(tmp_path, config)
    assert run_tokenizer(tmp_path / "none", {"model": {}}).kind == "bytes"
    ids = run_tokenizer(tmp_path / "none", {"tokenizer": "ids", "model": {"vocab_size": 9}})
    assert ids.kind == "ids" and ids.vocab_size == 9


def test_ids_tokenizer_reads_and_writes_numbers() -> None:
    tok = IdsTokenizer(100)
    assert tok.encode("3 14, 159 7") == [3, 14, 7]  # 159 is not an id
    assert tok.decode([1, 2, 3]) == " 1 2 3"


def test_bpe_corpus_records_val_bytes_and_reports_bits_per_byte(bpe: HFTokenizer) -> None:
    raw = TEXT.encode()
    data = TextData(raw[:4000], raw[4000:], "t")
    corpus = D.build_corpus(data, bpe, 320)
    assert corpus.val_bytes == len(raw) - 4000
    assert int(bpe.byte_lengths()[corpus.val].sum()) == corpus.val_bytes  # both ways agree
    assert corpus.train.dtype == np.uint16 and corpus.vocab_size == 320
    nats = 1.5
    expected = nats * len(corpus.val) / corpus.val_bytes / math.log(2)
    assert D.bits_per_byte(nats, corpus) == pytest.approx(expected)
    by_bytes = D.build_corpus(data, ByteTokenizer(), 256)
    assert D.bits_per_byte(nats, by_bytes) == pytest.approx(nats / math.log(2))


def test_model_vocabulary_smaller_than_the_tokenizer_is_refused(bpe: HFTokenizer) -> None:
    with pytest.raises(
        DataError, match="has 320 tokens but the model 256; pass --model.vocab-size 320"
    ):
        D.build_corpus(TextData(b"abc", b"def", "t"), bpe, 256)
