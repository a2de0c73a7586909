"""Cache simulation of the hashed n-gram tables (`stem_ngram`, `engram`): the id stream decoding would read.

Each decoded token looks up K = orders x heads n-gram rows. With shared hashing every n-gram layer reads the
same ids, so one row cache serves them all and sees one step of K ids per token. With per-layer hashing
(`engram_variant=reference`) each layer has its own ids and table, and offload gives each its own cache
(`OffloadProviders.ngram_layers`): each layer's stream is replayed through a cache of its own, and the report
sums their hits and lookups (the hit rate of all the n-gram caches together) and keeps each layer's rows.
`ngram_id_streams` hashes a token stream exactly as the model does (`stemlm.model.ngram`, the stream read as
one sequence); the replays use the same `CachePolicy` as the token rows, with cache sizes as fractions of the
n-gram table rows.
"""

from __future__ import annotations

import torch

from stemlm.model.config import ModelConfig
from stemlm.model.ngram import ngram_hasher
from stemlm.offload.cache import replay_grid

COUNTS = ("hits", "misses", "lookups")


def ngram_id_streams(config: ModelConfig, tokens: list[int]) -> tuple[dict[int | None, tuple[list[int], int]], int]:
    """({cache: (flattened [L, K] n-gram row ids, table rows)}, K) of a token stream: one cache (key None) for
    shared hashing, one per table key for per-layer hashing; ({}, 0) without n-gram tables."""
    hasher = ngram_hasher(config)
    if hasher is None:
        return {}, 0
    ids = torch.tensor([tokens], dtype=torch.long)
    keys = hasher.ids(ids, torch.full((1, hasher.context), -1))
    if hasher.shared:
        return {None: (keys[0].reshape(-1).tolist(), hasher.num_rows)}, hasher.num_keys
    streams = {layer: (k[0].reshape(-1).tolist(), hasher.num_rows_of(layer)) for layer, k in keys.items()}
    return streams, hasher.num_keys


def simulate_ngram(config: ModelConfig, tokens: list[int], fractions, policies, on_replay=None) -> dict | None:
    """Hit rates of the n-gram row caches for each fraction of their rows and policy; None without n-gram tables.
    With per-layer caches the counts are summed over layers and `layers` holds each one's own report.
    `on_replay`: called after each replay (`replay_grid`)."""
    streams, keys = ngram_id_streams(config, tokens)
    if not keys:
        return None
    reports = {
        layer: {
            "rows": rows,
            "keys_per_token": keys,
            "distinct_ids": len(set(stream)),
            "results": replay_grid(stream, rows, fractions, policies, COUNTS, step_tokens=keys, on_replay=on_replay),
        }
        for layer, (stream, rows) in streams.items()
    }
    if None in reports:
        return reports[None]
    per_layer = list(reports.values())
    results = []
    for cells in zip(*(r["results"] for r in per_layer), strict=True):
        summed = {k: sum(c[k] for c in cells) for k in (*COUNTS, "capacity")}  # hit rate as CacheStats's
        results.append({**cells[0], **summed, "hit_rate": summed["hits"] / max(summed["hits"] + summed["misses"], 1)})
    return {
        "rows": sum(r["rows"] for r in per_layer),
        "keys_per_token": keys,
        "distinct_ids": sum(r["distinct_ids"] for r in per_layer),
        "results": results,
        "layers": {str(layer): r for layer, r in reports.items()},
    }
