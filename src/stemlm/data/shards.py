"""Token shards: documents tokenized once into a memory-mapped token file, and batches sampled from it.

A shard is a flat array of token ids (uint16 when every id fits, else uint32) with the separator token
(`<|endoftext|>` unless another is named) after each document, stored raw as `<key>.<dtype>.bin` under the
cache directory (argument, else `$STEMLM_CACHE/tokens`, else `~/.cache/stemlm/tokens`). The key hashes the
texts, the separator and the tokenizer's JSON, so a changed corpus or tokenizer never reads a stale shard;
files are written to a temporary name and renamed, so an interrupted run leaves no half-written shard.
`TokenDataset.sample_batch` picks windows from (seed, step) alone, so a run resumed at step k sees exactly the
batches of an uninterrupted one: with `sampling="uniform"` (the default) starts drawn uniformly with replacement
from an RNG seeded by (seed, step), or, where `strata` is set (the fact world's documents after the corpus), with
a fixed share of every batch's rows from the tail (`stratified_starts`); with `sampling="epoch"` every aligned
window of seq_len + 1 tokens once per epoch, in the seeded Feistel order of prepared shards
(`stemlm.data.stream.epoch_windows`, one implementation).
`iter_eval_windows` walks fixed, non-overlapping windows for held-out evaluation.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from stemlm.data.tokenizer import EOT_TOKEN, separator_id
from stemlm.errors import StemlmError

SHARD_FORMAT = "stemlm-tokens-v1"  # bump when the on-disk layout or the document joining changes
ENCODE_CHUNK = 256  # documents per encode_batch call: bounds the memory held in Python lists


def default_cache_dir() -> Path:
    root = os.environ.get("STEMLM_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "stemlm") / "tokens"


def shard_key(texts: list[str], tok: Tokenizer, separator: str = EOT_TOKEN) -> str:
    """Content hash of (format, tokenizer JSON, separator, every text), length-prefixed so boundaries count."""
    h = hashlib.sha256(SHARD_FORMAT.encode())
    for part in [tok.to_str(), separator, *texts]:
        data = part.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:32]


def token_dtype(tok: Tokenizer) -> np.dtype:
    return np.dtype(np.uint16 if tok.get_vocab_size(with_added_tokens=True) <= 2**16 else np.uint32)


def build_shard(
    texts: list[str], tok: Tokenizer, cache_dir: str | Path | None = None, separator: str = EOT_TOKEN
) -> tuple[Path, bool]:
    """Tokenize `texts` into a cached shard file, `separator` after each; returns (path, True if cached)."""
    if not texts:
        raise StemlmError("no documents to tokenize")
    dtype = token_dtype(tok)
    eot = separator_id(tok, separator)
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = directory / f"{shard_key(texts, tok, separator)}.{dtype.name}.bin"
    if path.is_file():
        return path, True
    directory.mkdir(parents=True, exist_ok=True)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # the fast variant skips offsets (>= 0.20)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            for start in range(0, len(texts), ENCODE_CHUNK):
                for enc in encode(texts[start : start + ENCODE_CHUNK], add_special_tokens=False):
                    f.write(np.asarray(enc.ids + [eot], dtype=dtype).tobytes())
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path, False


SAMPLINGS = ("uniform", "epoch")


def stratified_starts(
    rng: np.random.Generator, num_tokens: int, seq_len: int, batch_size: int, step: int, split: int, share: float
) -> np.ndarray:
    """Window starts of batch `step` with its quota of rows in tokens[split:] and the rest in tokens[:split].

    The quota is the whole part of `share` x batch_size, carried from batch to batch (round((step + 1) x share x
    batch_size) - round(step x share x batch_size)), so every batch holds the same mix up to one row and any run
    of batches holds exactly its share; the tail's rows come first. A window stays inside its stratum."""
    if not (seq_len < split <= num_tokens - seq_len - 1 and 0 < share < 1):
        raise StemlmError(
            f"stratified windows need both strata longer than one window of {seq_len} tokens and a share in (0, 1); "
            f"got split {split} of {num_tokens} tokens, share {share}"
        )
    quota = math.floor((step + 1) * share * batch_size + 0.5) - math.floor(step * share * batch_size + 0.5)
    tail = rng.integers(split, num_tokens - seq_len, size=quota)
    head = rng.integers(0, split - seq_len, size=batch_size - quota)
    return np.concatenate([tail, head])


class TokenDataset:
    """A flat memory-mapped token array with seeded window sampling for training and evaluation.

    `sampling` ("uniform" or "epoch", see the module docstring) may be set after construction."""

    def __init__(
        self, tokens: np.ndarray, path: Path | None = None, from_cache: bool = False, sampling: str = "uniform"
    ) -> None:
        if sampling not in SAMPLINGS:
            raise StemlmError(f"sampling must be one of {', '.join(SAMPLINGS)}, got {sampling!r}")
        self.tokens = tokens
        self.path = path
        self.from_cache = from_cache
        self.sampling = sampling
        # (split, share): uniform windows drawn so that `share` of every batch's rows start in tokens[split:]
        # and the rest end before `split` (`stratified_starts`); None: from anywhere.
        self.strata: tuple[int, float] | None = None

    @classmethod
    def from_texts(
        cls, texts: list[str], tok: Tokenizer, cache_dir: str | Path | None = None, separator: str = EOT_TOKEN
    ) -> TokenDataset:
        """Tokenize (or reuse the cached shard of) `texts` and memory-map the result."""
        path, from_cache = build_shard(texts, tok, cache_dir, separator)
        return cls.from_file(path, from_cache)

    @classmethod
    def from_file(cls, path: str | Path, from_cache: bool = True) -> TokenDataset:
        path = Path(path)
        dtype_name = path.name.split(".")[-2] if path.name.endswith(".bin") else ""
        if dtype_name not in ("uint16", "uint32") or not path.is_file():
            raise StemlmError(
                f"not a stemlm token shard: {path} (expected an existing <key>.uint16.bin or .uint32.bin)"
            )
        dtype = np.dtype(dtype_name)
        size = path.stat().st_size
        if size == 0 or size % dtype.itemsize:
            what = "empty" if size == 0 else f"{size} bytes, not a whole number of {dtype.name} tokens"
            raise StemlmError(f"token shard {path} is {what}; delete it and rerun")
        return cls(np.memmap(path, dtype=dtype, mode="r"), path, from_cache)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def _check_window(self, seq_len: int) -> None:
        if seq_len < 1:
            raise StemlmError(f"seq_len must be positive, got {seq_len}")
        if self.num_tokens < seq_len + 1:
            raise StemlmError(
                f"dataset has {self.num_tokens} tokens but one window of seq_len {seq_len} needs {seq_len + 1}; "
                "use a shorter --seq-len or more data"
            )

    def _windows(self, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        # One gather of seq_len + 1 tokens per window; targets are the inputs shifted left by one.
        window = torch.from_numpy(self.tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64))
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def sample_batch(
        self, batch_size: int, seq_len: int, *, seed: int, step: int, rows: slice | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows as (inputs, targets) LongTensors of shape [batch_size, seq_len] (or only `rows` of it).

        They depend on (seed, step) only, so the batch at a given step never depends on what was drawn before
        it (exact resumption); a data-parallel rank reads just its `rows` of the global batch.
        """
        self._check_window(seq_len)
        if batch_size < 1:
            raise StemlmError(f"batch_size must be positive, got {batch_size}")
        if self.sampling == "epoch":
            from stemlm.data.stream import epoch_windows

            total = self.num_eval_windows(seq_len)
            if batch_size > total:
                raise StemlmError(
                    f"a batch of {batch_size} windows of {seq_len} tokens needs {batch_size} windows, but the dataset "
                    f"holds {total}; lower the batch size or seq_len, or add data"
                )
            return self._windows(epoch_windows(step, batch_size, total, seed, rows) * seq_len, seq_len)
        if batch_size * seq_len + 1 > self.num_tokens:
            raise StemlmError(
                f"a batch of {batch_size} x {seq_len} tokens needs at least {batch_size * seq_len + 1} tokens of "
                f"data, but the dataset has {self.num_tokens}; lower the batch size or seq_len, or add data"
            )
        rng = np.random.default_rng([seed, step])
        if self.strata is None:
            starts = rng.integers(0, self.num_tokens - seq_len, size=batch_size)
        else:
            starts = stratified_starts(rng, self.num_tokens, seq_len, batch_size, step, *self.strata)
        return self._windows(starts if rows is None else starts[rows], seq_len)

    def num_eval_windows(self, seq_len: int) -> int:
        """How many non-overlapping windows of `seq_len` (+1 target token) the data holds."""
        self._check_window(seq_len)
        return (self.num_tokens - 1) // seq_len

    def iter_eval_windows(
        self, seq_len: int, max_windows: int | None = None, batch_size: int = 8
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Fixed non-overlapping windows as (inputs, targets) batches of up to `batch_size` windows.

        With `max_windows` below the total, windows are spread evenly over the whole data rather than
        taken from its start, so a small evaluation budget still covers every held-out document.
        """
        total = self.num_eval_windows(seq_len)
        if max_windows is not None and max_windows < 1:
            raise StemlmError(f"max_windows must be positive, got {max_windows}")
        chosen = np.arange(total)
        if max_windows is not None and max_windows < total:
            chosen = np.linspace(0, total - 1, num=max_windows).round().astype(np.int64)
        starts = chosen * seq_len
        for i in range(0, len(starts), batch_size):
            yield self._windows(starts[i : i + batch_size], seq_len)
