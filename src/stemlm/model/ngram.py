"""Hashed n-gram keys, shared by the kinds with `ngram` tables (`stem_ngram`, `engram`).

Keys. For every order n (`orders`, e.g. (2,) or (2, 3)) the last n input ids are mixed as in Engram
(arXiv 2601.07372): `mix = XOR_j (t_{-j} + 1) * m_j` with odd multipliers m_j drawn from `seed`, then each of
`heads` hash heads takes `mix mod p_h`, p_h its own prime table size (distinct primes >= `rows`), so two
n-grams collide in every head only rarely. The heads' tables are stacked into one [Σ p_h, width] table and
`NgramHasher.ids` returns row ids into it, [B, T, K] with K = len(orders) · heads. A position before the
start of the sequence (or a left-padding position) is the id V (one past the vocabulary).

The multipliers depend on the model's `hash_seed` only, not on the layer, so every n-gram layer of a model
looks up the same row ids: offload then fetches one token-major row per id for all layers at once (as for
the STEM token tables), and the ids depend on the input ids alone, so they are known before any compute.

`model(..., rows={"ngram": fn})` supplies the n-gram rows from outside (`fn(layer_idx, ngram_ids) ->
[B, T, K, width]`), the way `rows={"token": ...}` supplies the token rows.

`PerLayerNgramHasher` is DeepSeek's Engram demo's hashing (`engram_variant="reference"`): the multipliers are drawn
per layer (numpy's default_rng seeded with seed + 10007 · layer, as the demo draws them), the ids are mixed as they
are (no + 1), a position before the start (or a padding position) is the pad id, and every (layer, order, head)
has its own prime table size (`stemlm.model.ngram_layout.per_layer_primes`). Its `ids` are per layer (a dict), so
offload keeps a store and row cache per n-gram table for it (`stemlm.offload.families`), not one token-major store.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn

from stemlm.errors import StemlmError
from stemlm.model.ffn import TokenContext
from stemlm.model.kinds.registry import Config
from stemlm.model.ngram_layout import NgramLayout, ngram_layout

INT64_MAX = 2**63 - 1


class NgramHasher:
    """Row ids of the hashed n-grams ending at every position (no parameters; the same for every layer)."""

    def __init__(self, vocab_size: int, layout: NgramLayout, seed: int) -> None:
        self.vocab_size, self.orders, self.heads = vocab_size, layout.orders, layout.heads
        self.context = max(self.orders) - 1  # previous ids a position needs
        # Ids + 1 are in [1, V + 1] (V = no token); products stay below 2^63 so the XOR and mod are exact in int64.
        bound = max(1, INT64_MAX // (vocab_size + 1) // 2)
        rng = random.Random(seed)
        self.multipliers = [2 * rng.randrange(bound) + 1 for _ in range(max(self.orders))]
        self.sizes = list(layout.sizes)
        self.offsets = [sum(self.sizes[:k]) for k in range(len(self.sizes))]
        self.num_rows = sum(self.sizes)

    shared = True  # every layer looks up the same ids

    @property
    def num_keys(self) -> int:
        return len(self.sizes)

    def num_rows_of(self, layer_idx: int) -> int:
        return self.num_rows

    def ids(self, input_ids: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """[B, T, K] row ids for `input_ids` [B, T] given the `prev_ids` [B, context] just before them (-1 or V:
        no token). Any device; int64 arithmetic only, so every device gives the same ids."""
        none = self.vocab_size
        prev = prev_ids.long().masked_fill(prev_ids < 0, none)
        seq = torch.cat([prev[:, prev.shape[1] - self.context :], input_ids.long().masked_fill(input_ids < 0, none)], 1)
        seq = seq + 1  # so id 0 still depends on its multiplier
        T = input_ids.shape[1]
        shifted = [seq[:, self.context - j : self.context - j + T] for j in range(max(self.orders))]
        out, k = [], 0
        for n in self.orders:
            mix = shifted[0] * self.multipliers[0]
            for j in range(1, n):
                mix = torch.bitwise_xor(mix, shifted[j] * self.multipliers[j])
            for _ in range(self.heads):
                out.append(torch.remainder(mix, self.sizes[k]) + self.offsets[k])
                k += 1
        return torch.stack(out, dim=-1)


# The demo's per-layer seed stride: layer l's multipliers come from default_rng(seed + LAYER_SEED_STRIDE * l).
LAYER_SEED_STRIDE = 10007


class PerLayerNgramHasher:
    """The Engram demo's hashing: row ids of the hashed n-grams ending at every position, per layer."""

    shared = False

    def __init__(self, vocab_size: int, layout: NgramLayout, seed: int, pad_id: int) -> None:
        self.vocab_size, self.orders, self.heads, self.pad_id = vocab_size, layout.orders, layout.heads, pad_id
        self.context = max(self.orders) - 1
        # Ids are in [0, V): the demo's bound keeps every product below 2^63.
        bound = max(1, INT64_MAX // vocab_size // 2)
        self.multipliers, self.sizes = {}, {}
        for layer, sizes in layout.layer_sizes:
            drawn = np.random.default_rng(seed + LAYER_SEED_STRIDE * layer).integers(
                0, bound, size=max(self.orders), dtype=np.int64
            )
            self.multipliers[layer] = [2 * int(r) + 1 for r in drawn]
            self.sizes[layer] = list(sizes)
        self.num_keys = len(self.orders) * self.heads

    def num_rows_of(self, layer_idx: int) -> int:
        return sum(self.sizes[layer_idx])

    def ids(self, input_ids: torch.Tensor, prev_ids: torch.Tensor) -> dict[int, torch.Tensor]:
        """Layer -> [B, T, K] row ids into that layer's stacked table, for `input_ids` [B, T] given the `prev_ids`
        [B, context] just before them (-1: no token, hashed as the pad id)."""
        prev = prev_ids.long()
        seq = torch.cat([prev[:, prev.shape[1] - self.context :], input_ids.long()], 1)
        seq = seq.masked_fill(seq < 0, self.pad_id)
        T = input_ids.shape[1]
        shifted = [seq[:, self.context - j : self.context - j + T] for j in range(max(self.orders))]
        out = {}
        for layer, multipliers in self.multipliers.items():
            sizes = self.sizes[layer]
            keys, k, offset = [], 0, 0
            for n in self.orders:
                mix = shifted[0] * multipliers[0]
                for j in range(1, n):
                    mix = torch.bitwise_xor(mix, shifted[j] * multipliers[j])
                for _ in range(self.heads):
                    keys.append(torch.remainder(mix, sizes[k]) + offset)
                    offset += sizes[k]
                    k += 1
            out[layer] = torch.stack(keys, dim=-1)
        return out


def ngram_hasher(config: Config) -> NgramHasher | PerLayerNgramHasher | None:
    """The model's hasher (one per model, for all its n-gram layers), or None for kinds without n-gram keys."""
    layout = ngram_layout(config)
    if layout is None:
        return None
    if layout.layer_sizes:
        return PerLayerNgramHasher(config.vocab_size, layout, config.hash_seed, layout.pad_id)
    return NgramHasher(config.vocab_size, layout, config.hash_seed)


def ngram_lookup(table: nn.Embedding, ctx: TokenContext, layer_idx: int, layer: int | None = None) -> torch.Tensor:
    """The n-gram rows of every position, [B, T, K, width]: from `table`, or from `ctx.rows["ngram"]` when set.
    `layer_idx` is the table key rows are asked for by; `layer` the layer whose ids to take when they are per layer."""
    ids = ctx.ngram_ids
    if isinstance(ids, dict):
        ids = ids.get(layer)
    if ids is None:
        raise StemlmError("an n-gram layer ran without n-gram ids in its TokenContext (call it through StemLM)")
    provider = ctx.rows.get("ngram")
    if provider is None:
        return table(ids)
    rows = provider(layer_idx, ids)
    expected = (*ids.shape, table.embedding_dim)
    if tuple(rows.shape) != expected:
        raise StemlmError(
            f"rows['ngram'] returned shape {list(rows.shape)} for layer {layer_idx}; expected {list(expected)}"
        )
    return rows
