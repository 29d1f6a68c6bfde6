"""Corpus loading, tokenizer, the step-indexed sampler, and the errors users see."""

import numpy as np
import pytest
import torch

from isotrain.train.data import batches as D


def test_byte_tokenizer_round_trips_any_utf8() -> None:
    tok = D.ByteTokenizer()
    text = "héllo wörld ✓ 日本語 \x00 \U0001f600"
    assert tok.decode(tok.encode(text), errors="strict") == text
    assert max(tok.encode(text)) < 256


def test_default_corpus_is_stdlib_sources_split_by_file() -> None:
    c = D.load_corpus(None, max_bytes=300_000, val_fraction=0.1)
    assert "stdlib" in c.source
    assert 250_000 <= len(c.train) + len(c.val) <= 300_000
    assert len(c.val) > 0
    assert b"def " in bytes(c.train[:100_000])
    again = D.load_corpus(None, max_bytes=300_000, val_fraction=0.1)
    assert np.array_equal(c.train, again.train)


def test_text_file_and_directory(tmp_path) -> None:
    f = tmp_path / "a.txt"
    f.write_text("abc" * 1000)
    c = D.load_corpus(str(f), max_bytes=10**6, val_fraction=0.1)
    assert len(c.train) == 2700 and len(c.val) == 300
    d = tmp_path / "dir"
    d.mkdir()
    for i in range(10):
        (d / f"{i}.txt").write_text(str(i) * 100)
    c = D.load_corpus(str(d), max_bytes=10**6, val_fraction=0.1)
    assert len(c.val) == 100 and len(c.train) == 900


def test_token_arrays_are_memory_mapped(tmp_path) -> None:
    ids = np.arange(5000, dtype=np.uint16) % 1000
    np.save(tmp_path / "t.npy", ids)
    ids.tofile(tmp_path / "t.bin")
    for name in ("t.npy", "t.bin"):
        c = D.load_corpus(str(tmp_path / name), max_bytes=1, val_fraction=0.2, vocab_size=1000)
        assert isinstance(c.train.base, np.memmap) or isinstance(c.train, np.memmap)
        assert len(c.train) == 4000 and int(c.val[-1]) == 4999 % 1000


def test_missing_path_is_a_clear_error() -> None:
    with pytest.raises(D.DataError, match="--data.path /no/such: no such file or directory"):
        D.load_corpus("/no/such", max_bytes=100, val_fraction=0.1)


def test_empty_corpus_is_a_clear_error(tmp_path) -> None:
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(D.DataError, match="the corpus is empty"):
        D.load_corpus(str(tmp_path / "empty.txt"), max_bytes=100, val_fraction=0.1)


def test_corpus_shorter_than_a_block_is_a_clear_error(tmp_path) -> None:
    (tmp_path / "short.txt").write_text("x" * 100)
    c = D.load_corpus(str(tmp_path / "short.txt"), max_bytes=1000, val_fraction=0.1)
    with pytest.raises(
        D.DataError, match=r"val split .* has 10 tokens per rank, fewer than one block \(32 \+ 1\)"
    ):
        D.require_length(c, 32)


def test_token_id_beyond_vocab_is_a_clear_error(tmp_path) -> None:
    np.save(tmp_path / "t.npy", np.array([1, 2, 700], dtype=np.uint16))
    with pytest.raises(
        D.DataError, match="token id 700 >= vocabulary size 256; pass --model.vocab-size 701"
    ):
        D.load_corpus(str(tmp_path / "t.npy"), max_bytes=1, val_fraction=0.1)


def test_wrong_array_dtype_is_a_clear_error(tmp_path) -> None:
    np.save(tmp_path / "t.npy", np.zeros(10, dtype=np.float32))
    with pytest.raises(D.DataError, match="expected a 1-D uint8, uint16 or uint32 token array"):
        D.load_corpus(str(tmp_path / "t.npy"), max_bytes=1, val_fraction=0.1)


def test_batches_are_a_pure_function_of_seed_step_micro_rank() -> None:
    tokens = np.arange(10_000, dtype=np.uint16)
    kw = dict(batch_size=4, block_size=8, seed=1)
    x1, y1 = D.get_batch(tokens, step=3, micro=1, **kw)
    x2, y2 = D.get_batch(tokens, step=3, micro=1, **kw)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are inputs shifted by one
    x3, _ = D.get_batch(tokens, step=4, micro=1, **kw)
    assert not torch.equal(x1, x3)


def test_ranks_draw_from_disjoint_shards() -> None:
    tokens = np.arange(10_000, dtype=np.uint16)
    kw = dict(batch_size=16, block_size=8, seed=1, step=0, world_size=2)
    _x0, y0 = D.get_batch(tokens, rank=0, **kw)
    x1, _y1 = D.get_batch(tokens, rank=1, **kw)
    assert int(y0.max()) < 5000 <= int(x1.min())


def test_evaluation_windows_cover_the_split_once_where_they_fit() -> None:
    tokens = np.arange(1003, dtype=np.uint16)  # 125 windows of 8 + 1: the last one is partial
    batches = list(D.eval_windows(tokens, batch_size=16, block_size=8, max_batches=100))
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    assert [len(b[0]) for b in batches] == [16] * 7 + [13]  # 125 windows, the last batch short
    assert torch.equal(x.flatten(), torch.arange(1000))  # every input token once, in order
    assert torch.equal(y.flatten(), torch.arange(1, 1001))  # targets: inputs shifted by one


def test_evaluation_windows_spread_evenly_past_the_budget_and_per_rank() -> None:
    tokens = np.arange(100_001, dtype=np.uint32)  # 12,500 windows of 8 + 1
    (x, _y), (x2, _y2) = D.eval_windows(tokens, batch_size=4, block_size=8, max_batches=2)
    starts = torch.cat([x, x2])[:, 0].tolist()
    assert starts == [i * 12_500 // 8 * 8 for i in range(8)]  # windows 0, 1562, 3125, ...
    kw = dict(batch_size=4, block_size=8, max_batches=1, world_size=2)
    ((_, t0),) = D.eval_windows(tokens, rank=0, **kw)
    ((r1, _),) = D.eval_windows(tokens, rank=1, **kw)
    assert int(t0.max()) <= 50_000 <= int(r1.min())  # each rank in its own shard
    assert int(r1[0, 0]) == 50_000


def test_unigram_baseline_matches_a_direct_computation() -> None:
    c = D.Corpus(np.array([0, 0, 1, 1], np.uint8), np.array([0, 1], np.uint8), "t", 4)
    p = np.array([3, 3, 1, 1]) / 8  # add-one counts
    expected = -(np.log(p[0]) + np.log(p[1])) / 2
    assert D.unigram_entropy(c) == pytest.approx(expected)


def test_nanogpt_folder_is_read_memory_mapped(tmp_path) -> None:
    ids = (np.arange(6000) * 7 % 1000).astype(np.uint16)
    ids[:5000].tofile(tmp_path / "train.bin")
    ids[5000:].tofile(tmp_path / "val.bin")
    c = D.load_corpus(str(tmp_path), max_bytes=1, val_fraction=0.1, vocab_size=1000)
    assert isinstance(c.train, np.memmap) and isinstance(c.val, np.memmap)
    assert np.array_equal(c.train, ids[:5000]) and np.array_equal(c.val, ids[5000:])
    assert c.val_bytes is None  # no tokenizer known: no bits per byte
    kw = dict(batch_size=4, block_size=16, seed=3, step=2)
    x_map, y_map = D.get_batch(c.train, **kw)
    x_ram, y_ram = D.get_batch(np.array(ids[:5000]), **kw)
    assert torch.equal(x_map, x_ram) and torch.equal(y_map, y_ram)
    with pytest.raises(D.DataError, match="token id 999 >= vocabulary size 256"):
        D.load_corpus(str(tmp_path), max_bytes=1, val_fraction=0.1)


def test_separate_validation_paths(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("a" * 500)
    (tmp_path / "b.txt").write_text("b" * 300)
    (tmp_path / "v.txt").write_text("v" * 200)
    c = D.load_corpus(
        str(tmp_path / "[ab].txt"), max_bytes=1, val_fraction=0.5, val_path=str(tmp_path / "v.txt")
    )
    assert len(c.train) == 800 and bytes(c.val) == b"v" * 200 and c.val_bytes == 200
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "t.bin")
    np.arange(30, dtype=np.uint16).tofile(tmp_path / "v.bin")
    c = D.load_corpus(
        str(tmp_path / "t.bin"), max_bytes=1, val_fraction=0.1, val_path=str(tmp_path / "v.bin")
    )
    assert len(c.train) == 100 and len(c.val) == 30
    with pytest.raises(D.DataError, match="--data.val-path .*v.txt: expected a .bin/.npy token"):
        D.load_corpus(
            str(tmp_path / "t.bin"), max_bytes=1, val_fraction=0.1, val_path=str(tmp_path / "v.txt")
        )
    with pytest.raises(D.DataError, match=r"--data.path .*\*.md: the pattern matches no file"):
        D.load_corpus(str(tmp_path / "*.md"), max_bytes=1, val_fraction=0.1)


def test_unusable_token_files_are_one_line_errors(tmp_path) -> None:
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(D.DataError, match="empty.bin: the token file is empty"):
        D.load_corpus(str(tmp_path / "empty.bin"), max_bytes=1, val_fraction=0.1)
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(
        D.DataError,
        match="odd.bin: 3 bytes is not a whole number of uint16 tokens .* try --data.bin-dtype "
        "uint8 or uint32",
    ):
        D.load_corpus(str(tmp_path / "odd.bin"), max_bytes=1, val_fraction=0.1)
    np.save(tmp_path / "p.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(D.DataError, match="p.npy: not a plain .npy array .* never unpickles"):
        D.load_corpus(str(tmp_path / "p.npy"), max_bytes=1, val_fraction=0.1)
    with pytest.raises(D.DataError) as err:
        D.load_corpus(str(tmp_path / "odd.bin"), max_bytes=1, val_fraction=0.1)
    assert "\n" not in str(err.value)  # one line, for the CLI's `error:` line


def test_uint32_tokens(tmp_path) -> None:
    ids = np.array([70_000, 1, 2, 69_999] * 50, dtype=np.uint32)
    ids.tofile(tmp_path / "t.bin")
    c = D.load_corpus(
        str(tmp_path / "t.bin"),
        max_bytes=1,
        val_fraction=0.1,
        vocab_size=70_001,
        bin_dtype="uint32",
    )
    assert c.train.dtype == np.uint32 and int(c.train.max()) == 70_000
    assert D.token_dtype(65_536) == np.uint16 and D.token_dtype(65_537) == np.uint32
