"""Tokenizer, token files and datasets: round trips and a reproducible data order."""

import numpy as np
import pytest
import torch

from raypipe.data import ByteTokenizer, TokenDataset, read_tokens, stdlib_corpus, write_tokens


def test_byte_tokenizer_round_trips_any_text():
    tok = ByteTokenizer()
    text = "def f(x):\n    return x  # naïve — 測試 🚀"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode())
    assert tok.decode(ids) == text


def test_token_files_are_nanogpt_uint16(tmp_path):
    ids = np.array([0, 1, 255, 65535, 42], dtype=np.int64)
    path = write_tokens(tmp_path / "t.bin", ids)
    assert path.stat().st_size == 2 * len(ids)
    assert np.fromfile(path, dtype="<u2").tolist() == ids.tolist()
    assert read_tokens(path).tolist() == ids.tolist()
    with pytest.raises(ValueError, match="0..65535"):
        write_tokens(tmp_path / "bad.bin", [70000])


def test_batches_depend_only_on_seed_and_step():
    data = TokenDataset(np.arange(1000, dtype=np.uint16) % 256, block_size=8)
    x, y = data.batch(step=3, batch_size=4, seed=1)
    assert x.shape == y.shape == (4, 8) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    x2, _ = data.batch(step=3, batch_size=4, seed=1)
    assert torch.equal(x, x2)
    assert not torch.equal(x, data.batch(step=4, batch_size=4, seed=1)[0])
    assert not torch.equal(x, data.batch(step=3, batch_size=4, seed=2)[0])
    train, val = data.split(0.1)
    assert len(train) == 900 and len(val) == 100


def test_stdlib_corpus_is_deterministic_and_cached(tmp_path, corpus):
    again = stdlib_corpus(max_bytes=300_000, cache_dir=tmp_path)
    assert again.read_bytes() == corpus.read_bytes()
    tokens = read_tokens(corpus)
    assert len(tokens) == 300_000
    text = ByteTokenizer().decode(tokens[:2000])
    assert "def " in text or "import " in text


def test_text_file_dataset(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("hello world " * 20)
    data = TokenDataset.from_text_files([path], block_size=4)
    assert len(data) == 240
    with pytest.raises(ValueError, match="needs more than"):
        TokenDataset([1, 2, 3], block_size=4)
