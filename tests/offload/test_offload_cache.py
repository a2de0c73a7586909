"""The hot-row cache: replacement decisions against a deliberately naive reference simulation, hand-worked
examples of LRU / LFU / pinning, warm start, capacity resolution, and the rows `RowCache` serves."""

from __future__ import annotations

import random

import pytest
import torch

from stemlm.errors import StemlmError
from stemlm.offload.cache import CachePolicy, RowCache, resolve_capacity
from stemlm.offload.providers import HostProvider


def served(step) -> torch.Tensor:
    """The step's rows per position (an absent position map means the distinct ids were already in order)."""
    return step.rows if step.inverse is None else step.rows[step.inverse]


def run_policy(steps, capacity, policy, vocab, warm=None):
    cache = CachePolicy(vocab, capacity, policy, warm_counts=warm)
    for step in steps:
        cache.plan(step)
    s = cache.stats
    return dict(hits=s.hits, misses=s.misses, evictions=s.evictions, bypassed=s.bypassed), set(cache.cached_ids())


def zipf_steps(n_steps, vocab, seed, max_len=1):
    rng = random.Random(seed)
    weights = [1.0 / (r + 1) for r in range(vocab)]
    return [rng.choices(range(vocab), weights, k=rng.randint(1, max_len)) for _ in range(n_steps)]


def test_lru_and_lfu_differ_as_worked_by_hand():
    steps = [[1], [2], [1], [3], [2]]
    # LRU: 3 evicts 2 (least recent), then 2 evicts 1 -> {2, 3}; LFU: 3 evicts 2 (freq 1), 2 evicts 3 -> {1, 2}
    assert run_policy(steps, 2, "lru", 8) == (dict(hits=1, misses=4, evictions=2, bypassed=0), {2, 3})
    assert run_policy(steps, 2, "lfu", 8) == (dict(hits=1, misses=4, evictions=2, bypassed=0), {1, 2})


def test_pinned_rows_are_never_evicted_and_overflow_is_bypassed():
    cache = CachePolicy(16, 1, "lru")
    plan = cache.plan([5, 6])  # 5 takes the only slot; 6 finds it pinned by this step
    assert plan.ids == [5, 6] and plan.miss == [True, True] and plan.slots == [0, -1]
    plan = cache.plan([6])  # 5 is no longer pinned: evicted
    assert plan.slots == [0] and cache.cached_ids() == [6]
    plan = cache.plan([6, 6, 7])
    assert plan.ids == [6, 7] and plan.inverse == [0, 0, 1] and plan.miss == [False, True] and plan.slots == [0, -1]
    s = cache.stats
    assert (s.steps, s.lookups, s.unique_ids, s.hits, s.misses, s.bypassed, s.evictions) == (3, 6, 5, 1, 4, 2, 1)
    assert s.hit_rate == pytest.approx(1 / 5)


def test_capacity_zero_bypasses_everything():
    counts, cached = run_policy(zipf_steps(50, 30, seed=1, max_len=5), 0, "lfu", 30)
    assert counts["hits"] == 0 and counts["bypassed"] == counts["misses"] > 0 and not cached


@pytest.mark.parametrize("policy", ["lfu", "lru"])
@pytest.mark.parametrize("capacity", [0, 1, 3, 12, 40])
@pytest.mark.parametrize("max_len", [1, 9])
def test_counts_match_reference_simulation(policy, capacity, max_len, reference_sim):
    steps = zipf_steps(400, 60, seed=capacity * 10 + max_len, max_len=max_len)
    assert run_policy(steps, capacity, policy, 60) == reference_sim(steps, capacity, policy)


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_warm_start_matches_reference(policy, reference_sim):
    rng = random.Random(4)
    warm = [rng.choice([0, 0, 1, 5, 20]) for _ in range(40)]
    steps = zipf_steps(200, 40, seed=5, max_len=4)
    assert run_policy(steps, 10, policy, 40, warm) == reference_sim(steps, 10, policy, warm)
    cache = CachePolicy(40, 10, policy, warm_counts=warm)
    by_count = sorted((t for t in range(40) if warm[t]), key=lambda t: (-warm[t], t))[:10]
    assert cache.cached_ids() == sorted(by_count)


def test_resolve_capacity():
    assert resolve_capacity(8192, fraction=0.2) == 1638
    assert resolve_capacity(100, fraction=0.29) == 29  # 0.29 * 100 is 28.999... in floating point
    assert resolve_capacity(100, rows=7) == 7
    assert resolve_capacity(100) == 0
    with pytest.warns(UserWarning, match="clamped"):
        assert resolve_capacity(100, rows=500) == 100
    with pytest.warns(UserWarning, match="clamped"):
        assert resolve_capacity(100, fraction=1.5) == 100
    for bad in (dict(rows=-1), dict(fraction=-0.1), dict(rows=1, fraction=0.1)):
        with pytest.raises(StemlmError):
            resolve_capacity(100, **bad)
    with pytest.raises(StemlmError, match="policy"):
        CachePolicy(10, 2, "fifo")


@pytest.mark.parametrize("capacity", [0, 2, 7, 24])
def test_row_cache_serves_exact_rows_and_keeps_storage_consistent(capacity):
    gen = torch.Generator().manual_seed(0)
    tables = {1: torch.randn(24, 5, generator=gen), 3: torch.randn(24, 3, generator=gen)}
    provider = HostProvider(tables, layout="token")
    full = torch.cat([tables[1], tables[3]], dim=1)
    cache = RowCache(provider, capacity, "lfu")
    for step in zipf_steps(60, 24, seed=capacity, max_len=6):
        ids = torch.tensor(step).view(1, -1)
        got = cache.fetch(ids)
        assert torch.equal(served(got).view(1, len(step), 8), full[ids])
        for token in cache.policy.cached_ids():
            assert torch.equal(cache.storage[cache.policy.slot_of[token]], full[token])
    moved = cache.stats.misses * 8 * 4
    assert cache.stats.bytes_h2d == moved


def test_row_cache_warm_fill_loads_rows():
    table = torch.arange(40.0).view(10, 4)
    warm = [0, 9, 0, 4, 0, 0, 1, 0, 0, 0]
    cache = RowCache(HostProvider({2: table}), 2, "lfu", warm_counts=warm)
    assert cache.policy.cached_ids() == [1, 3]
    for token in (1, 3):
        assert torch.equal(cache.storage[cache.policy.slot_of[token]], table[token])
    got = cache.fetch(torch.tensor([[3, 1]]))
    assert cache.stats.hits == 2 and torch.equal(served(got), table[[3, 1]])
