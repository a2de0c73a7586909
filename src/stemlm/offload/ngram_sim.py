"""Cache simulation of the hashed n-gram tables (`stem_ngram`, `engram`): the id stream decoding would read.

Each decoded token looks up K = orders x heads n-gram rows (the same ids in every n-gram layer), so the
n-gram row cache sees one step of K ids per token. `ngram_id_stream` hashes a token stream exactly as the
model does (`stemlm.model.ngram.NgramHasher`, the stream read as one sequence); `simulate_ngram` replays it
through the same `CachePolicy` as the token rows, with cache sizes as fractions of the n-gram table rows.
"""

from __future__ import annotations

import torch

from stemlm.errors import StemlmError
from stemlm.model.config import ModelConfig
from stemlm.model.ngram import ngram_hasher
from stemlm.offload.cache import replay_grid


def ngram_id_stream(config: ModelConfig, tokens: list[int]) -> tuple[list[int], int, int]:
    """(flattened [L, K] n-gram row ids, K, table rows) of a token stream; ([], 0, 0) without n-gram tables."""
    hasher = ngram_hasher(config)
    if hasher is None:
        return [], 0, 0
    if not hasher.shared:
        raise StemlmError(
            "the n-gram cache simulation reads one shared hashing; engram_variant=reference hashes per layer"
        )
    ids = torch.tensor([tokens], dtype=torch.long)
    keys = hasher.ids(ids, torch.full((1, hasher.context), -1))[0]
    return keys.reshape(-1).tolist(), hasher.num_keys, hasher.num_rows


def simulate_ngram(config: ModelConfig, tokens: list[int], fractions, policies, on_replay=None) -> dict | None:
    """Hit rates of the n-gram row cache for each fraction of its rows and policy; None without n-gram tables.
    `on_replay`: called after each replay (`replay_grid`)."""
    stream, keys, rows = ngram_id_stream(config, tokens)
    if not keys:
        return None
    counts = ("hits", "misses", "lookups")
    results = replay_grid(stream, rows, fractions, policies, counts, step_tokens=keys, on_replay=on_replay)
    return {"rows": rows, "keys_per_token": keys, "distinct_ids": len(set(stream)), "results": results}
