"""Shared fixtures of the offload tests: a tiny STEM checkpoint on disk and the naive reference cache simulation.

`offload_model(ffn, seed, **overrides)` builds a tiny model of that shape;
`reference_sim(steps, capacity, policy, warm=None) -> (counts, cached_ids)` is the cache's definition written
as plainly as possible (sets and full scans), independent of the heap / slot implementation it checks.
"""

from __future__ import annotations

import pytest

from stemlm.checkpoint.folder import save_pretrained
from stemlm.model import build_model
from stemlm.model.config import ModelConfig

# initializer_range 0.1 makes logits peaked enough that greedy choices are far from ties.
CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    ffn_layers="all-but-first",
    ple_dim=16,
    initializer_range=0.1,
)


def make_model(ffn: str = "stem", seed: int = 0, **overrides):
    return build_model(ModelConfig(**{**CONFIG, "ffn": ffn, **overrides}), seed=seed).eval()


@pytest.fixture(scope="module")
def stem_checkpoint(tmp_path_factory):
    """(folder, resident model) of a tiny STEM checkpoint with tables in layers 1 and 2."""
    model = make_model("stem", seed=3)
    folder = tmp_path_factory.mktemp("ckpt") / "stem"
    save_pretrained(model, folder)
    return folder, model


@pytest.fixture
def offload_model():
    """Factory: `offload_model(ffn="stem", seed=0, **config_overrides) -> StemLM` in eval mode."""
    return make_model


@pytest.fixture
def reference_sim():
    return _reference_sim


def _reference_sim(steps, capacity, policy, warm=None):
    """The cache semantics written as plainly as possible: a set, full scans, no heaps, no slots.

    Per step: distinct ids in first-occurrence order; every occurrence adds 1 to the id's frequency; each
    distinct id is touched (a global counter) in that order; all of the step's ids are pinned; a miss takes
    free room or evicts the unpinned cached id with the least (frequency, touch) for LFU or touch for LRU,
    and is served without caching (bypassed) when every cached id is pinned.
    """
    cached, freq, touched, clock = set(), {}, {}, 0
    counts = dict(hits=0, misses=0, evictions=0, bypassed=0)
    if warm is not None:
        freq = {t: c for t, c in enumerate(warm) if c}
        best = sorted(freq, key=lambda t: (-freq[t], t))[:capacity]
        for t in reversed(best):
            clock += 1
            touched[t] = clock
            cached.add(t)
    for step in steps:
        distinct = []
        for t in step:
            freq[t] = freq.get(t, 0) + 1
            if t not in distinct:
                distinct.append(t)
        for t in distinct:
            clock += 1
            touched[t] = clock
        for t in distinct:
            if t in cached:
                counts["hits"] += 1
                continue
            counts["misses"] += 1
            if len(cached) < capacity:
                cached.add(t)
                continue
            candidates = [c for c in cached if c not in distinct]
            if not candidates:
                counts["bypassed"] += 1
                continue
            if policy == "lru":
                victim = min(candidates, key=lambda c: touched[c])
            else:
                victim = min(candidates, key=lambda c: (freq[c], touched[c]))
            cached.remove(victim)
            cached.add(t)
            counts["evictions"] += 1
    return counts, cached
