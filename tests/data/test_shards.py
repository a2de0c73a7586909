"""Token shards: caching, layout, seeded (seed, step) batch sampling, evaluation windows and errors."""

import numpy as np
import pytest
import torch

from stemlm.data.shards import TokenDataset, build_shard, default_cache_dir, token_dtype
from stemlm.data.tokenizer import train_bpe
from stemlm.errors import StemlmError

TEXTS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (5 + i) for i in range(6)]


@pytest.fixture(scope="module")
def tok():
    return train_bpe(TEXTS, vocab_size=300)


@pytest.fixture
def dataset(tok, tmp_path):
    return TokenDataset.from_texts(TEXTS, tok, cache_dir=tmp_path)


def test_shard_layout_and_cache_hit(tok, tmp_path):
    path, cached = build_shard(TEXTS, tok, cache_dir=tmp_path)
    assert not cached and path.name.endswith(".uint16.bin")
    expected = [i for text in TEXTS for i in tok.encode(text).ids + [0]]  # EOT (id 0) after every document
    assert np.fromfile(path, dtype=np.uint16).tolist() == expected
    again, cached = build_shard(TEXTS, tok, cache_dir=tmp_path)
    assert cached and again == path
    assert TokenDataset.from_texts(TEXTS, tok, cache_dir=tmp_path).from_cache
    changed, cached = build_shard(TEXTS[:-1], tok, cache_dir=tmp_path)
    assert not cached and changed != path
    assert not list(tmp_path.glob("*.tmp"))


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("STEMLM_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path / "tokens"


def test_dtype_follows_vocab_size():
    class Wide:
        def get_vocab_size(self, with_added_tokens=True):
            return 70000

    assert token_dtype(Wide()) == np.uint32


def test_sample_batch_is_a_function_of_seed_and_step(dataset):
    x, y = dataset.sample_batch(4, 16, seed=7, step=3)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, _ = dataset.sample_batch(4, 16, seed=7, step=3)
    assert torch.equal(x, x2)
    assert not torch.equal(x, dataset.sample_batch(4, 16, seed=7, step=4)[0])
    assert not torch.equal(x, dataset.sample_batch(4, 16, seed=8, step=3)[0])


def test_eval_windows_are_fixed_and_non_overlapping(dataset):
    seq_len = 10
    total = dataset.num_eval_windows(seq_len)
    batches = list(dataset.iter_eval_windows(seq_len, batch_size=4))
    inputs = torch.cat([x for x, _ in batches])
    assert inputs.shape == (total, seq_len)
    tokens = torch.from_numpy(dataset.tokens[: total * seq_len].astype(np.int64))
    assert torch.equal(inputs.reshape(-1), tokens)
    some = torch.cat([x for x, _ in dataset.iter_eval_windows(seq_len, max_windows=3)])
    assert some.shape == (3, seq_len) and torch.equal(some[0], inputs[0]) and torch.equal(some[-1], inputs[-1])


def test_too_little_data_errors(tok, tmp_path):
    small = TokenDataset.from_texts(["the cat"], tok, cache_dir=tmp_path)
    with pytest.raises(StemlmError, match=f"needs {small.num_tokens + 10}"):
        small.sample_batch(1, small.num_tokens + 9, seed=0, step=0)
    big = TokenDataset.from_texts(TEXTS, tok, cache_dir=tmp_path)
    with pytest.raises(StemlmError, match="lower the batch size"):
        big.sample_batch(big.num_tokens, 8, seed=0, step=0)
    with pytest.raises(StemlmError, match="no documents"):
        build_shard([], tok, cache_dir=tmp_path)
    with pytest.raises(StemlmError, match="not a stemlm token shard"):
        TokenDataset.from_file(tmp_path / "missing.uint16.bin")


def test_epoch_sampling_reads_every_aligned_window_once_per_epoch():
    # Token i at position i: a window's first token is its start.
    dataset = TokenDataset(np.arange(203, dtype=np.uint16), sampling="epoch")
    seq_len, batch = 8, 5
    total = (dataset.num_tokens - 1) // seq_len  # 25 aligned windows
    epochs = []
    for epoch in range(2):
        starts = []
        for step in range(epoch * 5, epoch * 5 + 5):
            x, y = dataset.sample_batch(batch, seq_len, seed=4, step=step)
            assert torch.equal(x, x[:, :1] + torch.arange(seq_len)) and torch.equal(y, x + 1)
            starts += x[:, 0].tolist()
            part, _ = dataset.sample_batch(batch, seq_len, seed=4, step=step, rows=slice(1, 3))  # a rank's rows
            assert torch.equal(part, x[1:3])
        assert sorted(starts) == list(range(0, total * seq_len, seq_len))  # each window once per epoch
        epochs.append(starts)
    assert epochs[0] != epochs[1] and epochs[0] != sorted(epochs[0])  # a fresh, shuffled order each epoch
    other_seed = [dataset.sample_batch(batch, seq_len, seed=5, step=s)[0][:, 0].tolist() for s in range(5)]
    assert sum(other_seed, []) != epochs[0]
    with pytest.raises(StemlmError, match="windows"):
        dataset.sample_batch(total + 1, seq_len, seed=0, step=0)
    with pytest.raises(StemlmError, match="sampling"):
        TokenDataset(dataset.tokens, sampling="shuffled")


def test_sampling_choice_per_data_kind(tmp_path):
    from stemlm.train.config import TrainConfig
    from stemlm.train.data import resolve_sampling

    assert resolve_sampling(TrainConfig()) == "uniform"  # the embedded corpus keeps the published figures' draws
    assert resolve_sampling(TrainConfig(data=["x.txt"], sampling="epoch")) == "epoch"
    (tmp_path / "manifest.json").write_text("{}")  # a prepared folder is recognised by its manifest
    assert resolve_sampling(TrainConfig(data=[str(tmp_path)])) == "epoch"
    with pytest.raises(StemlmError, match="per epoch only"):
        resolve_sampling(TrainConfig(data=[str(tmp_path)], sampling="uniform"))
    with pytest.raises(StemlmError, match="sampling must be one of"):
        TrainConfig(sampling="shuffled")


def test_stratified_batches_hold_their_share_of_tail_windows():
    """With `strata` (split, share) every batch draws its quota of windows from tokens[split:] and the rest from
    before it: quotas differ by at most one row between batches and add up to the share over any run of them."""
    tokens = np.concatenate([np.zeros(5000, dtype=np.uint16), np.ones(2000, dtype=np.uint16)])  # corpus 0, facts 1
    data = TokenDataset(tokens)
    data.strata = (5000, 0.3)
    quotas = []
    for step in range(50):
        x, y = data.sample_batch(8, 16, seed=1, step=step)
        window = torch.cat([x, y[:, -1:]], 1)
        assert all(row.unique().numel() == 1 for row in window)  # no window crosses the split
        quotas.append(int(window[:, 0].sum()))
        assert torch.equal(x, data.sample_batch(8, 16, seed=1, step=step)[0])  # still a function of (seed, step)
        assert torch.equal(x[2:4], data.sample_batch(8, 16, seed=1, step=step, rows=slice(2, 4))[0])
    assert set(quotas) == {2, 3} and sum(quotas) == round(0.3 * 8 * 50)
    data.strata = (5000, 0.99)
    with pytest.raises(StemlmError, match="stratified windows need"):
        data.strata = (10, 0.5)
        data.sample_batch(8, 16, seed=1, step=0)
