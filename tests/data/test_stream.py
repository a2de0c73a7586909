"""Streaming a prepared folder: every window once per epoch, exact and per-rank batches, windows across shard
boundaries, checks on open, and resident memory that does not grow with the corpus.

Shards here hold `arange` tokens (window w then starts with token w * seq_len), written in the manifest format
of a real `prepare` run whose shard list is replaced. Run: `python -m pytest tests/data/test_stream.py -q`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from stemlm.data import train_bpe
from stemlm.data.prepare import prepare
from stemlm.data.stream import open_prepared, permute
from stemlm.errors import StemlmError


@pytest.fixture(scope="module")
def tok():
    return train_bpe(["a few words of text to train on. " * 10], vocab_size=280)


def make_folder(root: Path, tok, sizes: list[int], dtype=np.uint32, values=None) -> Path:
    """A prepared folder whose train split is shards of `sizes` tokens, holding arange (or `values`)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "in.txt").write_text("placeholder document")
    folder = root / "data"
    prepare([root / "in.txt"], tok, folder, progress=False)
    manifest = json.loads((folder / "manifest.json").read_text())
    for old in manifest["splits"]["train"]["shards"]:
        (folder / old["file"]).unlink()
    tokens = np.arange(sum(sizes), dtype=dtype) if values is None else values
    shards, start = [], 0
    for k, size in enumerate(sizes):
        name = f"train-{k:05d}.{np.dtype(dtype).name}.bin"
        tokens[start : start + size].tofile(folder / name)
        sha = hashlib.sha256((folder / name).read_bytes()).hexdigest()
        shards.append({"file": name, "tokens": size, "documents": 1, "sha256": sha})
        start += size
    manifest["dtype"] = np.dtype(dtype).name
    manifest["splits"]["train"] = {"tokens": sum(sizes), "documents": len(sizes), "shards": shards}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 100, 1000, 4097])
def test_permute_is_a_bijection(size):
    for epoch in (0, 1):
        assert sorted(permute(np.arange(size), size, seed=3, epoch=epoch).tolist()) == list(range(size))
    if size >= 64:
        a, b = (permute(np.arange(size), size, seed=3, epoch=e) for e in (0, 1))
        assert not np.array_equal(a, b) and not np.array_equal(a, np.arange(size))


def test_each_window_once_per_epoch_across_shards(tmp_path, tok):
    seq_len, batch = 10, 4
    train, _ = open_prepared(make_folder(tmp_path, tok, [37, 5, 58, 21]), tok)  # 121 tokens: 12 windows
    assert train.num_tokens == 121 and train.num_eval_windows(seq_len) == 12
    firsts = []
    for step in range(6):  # 24 samples = 2 epochs
        x, y = train.sample_batch(batch, seq_len, seed=5, step=step)
        assert x.shape == (batch, seq_len) and np.array_equal(y.numpy(), x.numpy() + 1)  # contiguous, across shards
        assert np.array_equal(x[:, 1:].numpy(), x[:, :1].numpy() + np.arange(1, seq_len))
        firsts += x[:, 0].tolist()
    assert sorted(firsts[:12]) == sorted(firsts[12:]) == [w * seq_len for w in range(12)]
    assert firsts[:12] != firsts[12:]  # a fresh order in the second epoch


def test_rows_and_resume_read_the_same_windows(tmp_path, tok):
    train, _ = open_prepared(make_folder(tmp_path, tok, [500, 300]), tok)
    full_x, full_y = train.sample_batch(8, 16, seed=1, step=9)
    for rank in range(4):
        part_x, part_y = train.sample_batch(8, 16, seed=1, step=9, rows=slice(2 * rank, 2 * rank + 2))
        assert part_x.equal(full_x[2 * rank : 2 * rank + 2]) and part_y.equal(full_y[2 * rank : 2 * rank + 2])
    again, _ = open_prepared(tmp_path / "data", tok)  # a resumed run reopens the folder: the same batch
    assert again.sample_batch(8, 16, seed=1, step=9)[0].equal(full_x)
    assert not train.sample_batch(8, 16, seed=2, step=9)[0].equal(full_x)


def test_open_checks_tokenizer_sizes_and_batch(tmp_path, tok):
    folder = make_folder(tmp_path, tok, [100])
    other = train_bpe(["completely different text for another vocabulary. " * 10], vocab_size=270)
    with pytest.raises(StemlmError, match="was tokenized with another tokenizer"):
        open_prepared(folder, other)
    train, _ = open_prepared(folder, tok)
    with pytest.raises(StemlmError, match="a batch of 20 windows of 10 tokens needs 20 windows, but .* holds 9"):
        train.sample_batch(20, 10, seed=0, step=0)
    with open(folder / "train-00000.uint32.bin", "r+b") as f:
        f.truncate(40)
    with pytest.raises(StemlmError, match="is 40 bytes, the manifest says 400"):
        open_prepared(folder, tok)


def _rss_anon_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise AssertionError("no RssAnon line")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc for resident memory")
def test_resident_memory_does_not_grow_with_corpus(tmp_path, tok):
    growth = {}
    open_prepared(make_folder(tmp_path / "warm", tok, [8192]), tok)[0].sample_batch(16, 256, seed=0, step=0)
    for tokens in (1 << 20, 1 << 25):  # 2 MiB and 64 MiB of uint16 tokens
        values = np.random.default_rng(0).integers(0, 256, size=tokens, dtype=np.uint16)
        folder = make_folder(tmp_path / str(tokens), tok, [tokens // 2, tokens - tokens // 2], np.uint16, values)
        del values
        before = _rss_anon_kib()
        train, _ = open_prepared(folder, tok)
        for step in range(200):  # windows all over the file
            train.sample_batch(16, 256, seed=0, step=step)
        growth[tokens] = _rss_anon_kib() - before
    # Anonymous (non-file) resident memory: a corpus read into RAM would add 64 MiB; mapped pages are file-backed.
    assert growth[1 << 25] < 8 * 1024, growth
    assert growth[1 << 25] - growth[1 << 20] < 4 * 1024, growth
