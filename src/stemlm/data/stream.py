"""Streaming training data from a prepared shard folder (`stemlm data prepare`): memory-mapped, sampled per epoch.

    data = open_prepared("shards/", tokenizer)            # (train, heldout or None), both `StreamDataset`
    x, y = data[0].sample_batch(8, 2048, seed=0, step=12, rows=slice(2, 4))   # this rank's rows only

The shards of a split are memory-mapped, never read into RAM: a batch gathers just its windows, so resident
memory does not grow with the corpus. Opening checks the manifest's schema (`stemlm.data.manifest`: the dtype
is uint16 or uint32, never one that would reinterpret the bytes), that each shard is a regular file whose size
is its token count times the dtype's width, and the tokenizer's digest against the one the shards were made
with (a mismatch is an error naming both). The shards themselves are not re-hashed: a same-size change of their
bytes is found by `verify_shards` (`stemlm data verify`) only, which reads the whole corpus.

Sampling is without replacement per epoch. The split is cut into W = (tokens - 1) // seq_len aligned windows
of seq_len + 1 tokens. Sample g of the run (micro-batch `step`, row b: g = step * batch_size + b) is window
`permute(g mod W)` of epoch g // W, where `permute` is a keyed Feistel bijection on [0, W) (cycle-walking on
the next power of four) with keys from (seed, epoch): every window once per epoch, a fresh order each epoch,
O(1) memory, and any sample computable alone, so a resumed run and each rank's slice of the global batch
read exactly the windows of the uninterrupted single-process run. `epoch_windows` is that mapping, shared with
text token shards under `sampling="epoch"` (`stemlm.data.shards.TokenDataset`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from stemlm.data.manifest import is_prepared, read_manifest
from stemlm.data.prepare import HASH_CHUNK, MANIFEST_NAME
from stemlm.errors import StemlmError
from stemlm.paths import input_file

__all__ = ["is_prepared", "manifest_digest", "open_prepared", "prepared_tokenizer", "read_manifest", "verify_shards"]

FEISTEL_ROUNDS = 4
_MASK64 = np.uint64(2**64 - 1)


def manifest_digest(folder: str | Path) -> str:
    """sha256 (16 hex digits) of the manifest, which holds every shard's sha256: the identity of the data."""
    return hashlib.sha256((Path(folder) / MANIFEST_NAME).read_bytes()).hexdigest()[:16]


def prepared_tokenizer(folder: str | Path) -> Tokenizer:
    """The tokenizer the shards of `folder` were made with (its copy inside the folder)."""
    from stemlm.data.tokenizer import load_tokenizer

    return load_tokenizer(input_file(Path(folder) / read_manifest(folder)["tokenizer"]["file"], "tokenizer"))


class ShardedTokens:
    """The shards of one split as one virtual flat token array (one read-only memmap per shard)."""

    def __init__(self, folder: Path, split: dict[str, Any], dtype: np.dtype) -> None:
        self.maps, sizes = [], []
        for shard in split["shards"]:
            path = input_file(folder / shard["file"], "shard")  # never a FIFO or /dev/zero behind a link
            expected, actual = shard["tokens"] * dtype.itemsize, path.stat().st_size
            if actual != expected:
                raise StemlmError(
                    f"shard {path} is {actual:,} bytes, the manifest says {expected:,} ({shard['tokens']:,} "
                    f"{dtype.name} tokens); rerun `stemlm data prepare`"
                )
            self.maps.append(np.memmap(path, dtype=dtype, mode="r"))
            sizes.append(shard["tokens"])
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.num_tokens = int(self.offsets[-1])

    def gather(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Rows of `length` tokens from the global offsets `starts` (a row may span two or more shards)."""
        out = np.empty((len(starts), length), dtype=np.int64)
        for i, start in enumerate(starts.tolist()):
            pos, filled = start, 0
            while filled < length:
                k = int(np.searchsorted(self.offsets, pos, side="right")) - 1
                local = pos - int(self.offsets[k])
                take = min(length - filled, int(self.offsets[k + 1]) - pos)
                out[i, filled : filled + take] = self.maps[k][local : local + take]
                filled, pos = filled + take, pos + take
        return out


def _mix(values: np.ndarray, key: np.uint64) -> np.ndarray:
    # splitmix64's finaliser: a cheap, well-mixed 64-bit hash (uint64 arithmetic wraps modulo 2**64).
    z = (values + key) & _MASK64
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def permute(index: np.ndarray, size: int, seed: int, epoch: int) -> np.ndarray:
    """A keyed bijection of [0, size) applied to `index`: a balanced Feistel network, cycle-walked."""
    half = max(1, (max(size - 1, 1).bit_length() + 1) // 2)
    low = np.uint64((1 << half) - 1)
    keys = np.random.default_rng([seed, epoch]).integers(0, 2**63, size=FEISTEL_ROUNDS, dtype=np.uint64)
    x = np.asarray(index, dtype=np.uint64).copy()
    todo = np.ones(x.shape, dtype=bool)
    while todo.any():
        v = x[todo]
        left, right = v >> np.uint64(half), v & low
        for key in keys:
            left, right = right, left ^ (_mix(right, key) & low)
        v = (left << np.uint64(half)) | right
        x[todo] = v
        todo[todo] = v >= size  # outside the domain: apply the permutation again (cycle-walking)
    return x.astype(np.int64)


def epoch_windows(step: int, batch_size: int, total: int, seed: int, rows: slice | None = None) -> np.ndarray:
    """Window indices in [0, total) of micro-batch `step` (or its `rows`): sample g = step * batch_size + b is
    window `permute(g mod total)` of epoch g // total (see the module docstring)."""
    samples = step * batch_size + np.arange(batch_size, dtype=np.int64)[rows if rows is not None else slice(None)]
    windows = np.empty_like(samples)
    epochs = samples // total
    for epoch in np.unique(epochs).tolist():
        here = epochs == epoch
        windows[here] = permute(samples[here] % total, total, seed, epoch)
    return windows


class StreamDataset:
    """One split of a prepared folder: memory-mapped tokens with epoch-wise sampling and evaluation windows."""

    from_cache = True

    def __init__(self, tokens: ShardedTokens, path: Path) -> None:
        self.data, self.path = tokens, path

    @property
    def num_tokens(self) -> int:
        return self.data.num_tokens

    def num_eval_windows(self, seq_len: int) -> int:
        if seq_len < 1:
            raise StemlmError(f"seq_len must be positive, got {seq_len}")
        if self.num_tokens < seq_len + 1:
            raise StemlmError(
                f"{self.path} has {self.num_tokens} tokens but one window of seq_len {seq_len} needs {seq_len + 1}; "
                "use a shorter --seq-len or more data"
            )
        return (self.num_tokens - 1) // seq_len

    def _windows(self, windows: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        block = torch.from_numpy(self.data.gather(windows * seq_len, seq_len + 1))
        return block[:, :-1].contiguous(), block[:, 1:].contiguous()

    def sample_batch(
        self, batch_size: int, seq_len: int, *, seed: int, step: int, rows: slice | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch `step` as (inputs, targets) [batch_size, seq_len], or only its `rows` (a rank's part)."""
        total = self.num_eval_windows(seq_len)
        if batch_size < 1:
            raise StemlmError(f"batch_size must be positive, got {batch_size}")
        if batch_size > total:
            raise StemlmError(
                f"a batch of {batch_size} windows of {seq_len} tokens needs {batch_size} windows, but {self.path} "
                f"holds {total}; lower the batch size or seq_len, or add data"
            )
        return self._windows(epoch_windows(step, batch_size, total, seed, rows), seq_len)

    def iter_eval_windows(
        self, seq_len: int, max_windows: int | None = None, batch_size: int = 8
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Fixed non-overlapping windows spread over the split (as `TokenDataset.iter_eval_windows`)."""
        total = self.num_eval_windows(seq_len)
        if max_windows is not None and max_windows < 1:
            raise StemlmError(f"max_windows must be positive, got {max_windows}")
        chosen = np.arange(total)
        if max_windows is not None and max_windows < total:
            chosen = np.linspace(0, total - 1, num=max_windows).round().astype(np.int64)
        for i in range(0, len(chosen), batch_size):
            yield self._windows(chosen[i : i + batch_size], seq_len)


def open_prepared(folder: str | Path, tokenizer: Tokenizer | None = None) -> tuple[StreamDataset, StreamDataset | None]:
    """(train, heldout or None) of a prepared folder; checks sizes and that `tokenizer` made the shards."""
    from stemlm.data.tokenizer import tokenizer_digest

    folder = Path(folder)
    manifest = read_manifest(folder)
    made_with = manifest["tokenizer"]
    if tokenizer is not None and tokenizer_digest(tokenizer) != made_with["sha256_16"]:
        raise StemlmError(
            f"{folder} was tokenized with another tokenizer ({made_with['vocab_size']} tokens, sha "
            f"{made_with['sha256_16']}) than this run's ({tokenizer.get_vocab_size()} tokens, sha "
            f"{tokenizer_digest(tokenizer)}); train with --tokenizer {folder / made_with['file']} or prepare again"
        )
    dtype = np.dtype(manifest["dtype"])
    splits = manifest["splits"]
    train = StreamDataset(ShardedTokens(folder, splits["train"], dtype), folder)
    if not splits["heldout"]["shards"]:
        return train, None
    return train, StreamDataset(ShardedTokens(folder, splits["heldout"], dtype), folder)


def verify_shards(folder: str | Path) -> None:
    """Re-hash every shard against the manifest (reads the whole corpus: run it on request, not per start)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            h = hashlib.sha256()
            with open(input_file(folder / shard["file"], "shard"), "rb") as f:
                while chunk := f.read(HASH_CHUNK):
                    h.update(chunk)
            if h.hexdigest() != shard["sha256"]:
                raise StemlmError(f"shard {folder / shard['file']} does not match its sha256 in the manifest")
