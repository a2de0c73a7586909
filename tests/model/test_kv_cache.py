"""The preallocated KV cache: the same keys/values as concatenation, written in place, growing geometrically.

Run: `python -m pytest tests/model/test_kv_cache.py -q`.
"""

from __future__ import annotations

import torch

from stemlm.model.attention import KVCache


def chunks(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 3, n, 4, generator=gen), torch.randn(2, 3, n, 4, generator=gen)) for n in lengths]


def test_update_returns_the_concatenation_through_growth_and_crop():
    cache = KVCache(num_layers=2)
    ref_k, ref_v = [], []
    for k, v in chunks([5, 1, 1, 7, 1, 30]):
        for layer in range(2):
            got_k, got_v = cache.update(layer, k, v)
        ref_k.append(k)
        ref_v.append(v)
        assert torch.equal(got_k, torch.cat(ref_k, dim=2)) and torch.equal(got_v, torch.cat(ref_v, dim=2))
    assert cache.length == 45 and cache.keys[0].shape[2] >= 45
    cache.crop(6)
    k, v = chunks([2], seed=1)[0]
    got_k, got_v = cache.update(0, k, v)
    assert torch.equal(got_k, torch.cat([ref_k[0], ref_k[1], k], dim=2))
    assert torch.equal(got_v, torch.cat([ref_v[0], ref_v[1], v], dim=2))


def test_with_a_capacity_hint_decoding_writes_in_place():
    cache = KVCache(num_layers=1, capacity=16)
    steps = chunks([4] + [1] * 12)
    cache.update(0, *steps[0])
    storage = cache.keys[0].untyped_storage().data_ptr()
    for k, v in steps[1:]:
        cache.update(0, k, v)
        assert cache.keys[0].untyped_storage().data_ptr() == storage  # no reallocation, no copy of the past
    assert cache.length == 16 and cache.keys[0].shape[2] == 16
    cache.update(0, *chunks([1])[0])  # past the hint: the buffer doubles
    assert cache.keys[0].shape[2] == 32 and cache.length == 17
