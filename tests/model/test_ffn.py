"""Tests of the token-aware FFNs (`stemlm.model.ffn`) against plain-tensor computations written out by hand.

Each layer is compared with raw matmuls and a table indexed position by position in Python, so an error in
the lookup (wrong ids, wrong table, wrong branch replaced) cannot cancel out.
"""

from __future__ import annotations

import pytest
import torch

from stemlm.errors import StemlmError
from stemlm.model.ffn import DenseFFN, TokenContext
from stemlm.model.kinds.ple import PLEFFN
from stemlm.model.kinds.stem import StemFFN
from stemlm.model.kinds.stem_gate import StemGateFFN


def _silu(h: torch.Tensor) -> torch.Tensor:
    return h * torch.sigmoid(h)


def _rows_by_hand(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    B, T = ids.shape
    return torch.stack([torch.stack([table[int(ids[b, t])] for t in range(T)]) for b in range(B)])


def _randomise(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)


def _inputs(config, B: int = 2, T: int = 5):
    return torch.randn(B, T, config.hidden_size), torch.randint(0, config.vocab_size, (B, T))


def test_dense_swiglu_matches_formula(tiny_config):
    config = tiny_config("dense")
    ffn = DenseFFN(config.hidden_size, config.intermediate_size)
    _randomise(ffn)
    x, _ = _inputs(config)
    expected = (_silu(x @ ffn.gate_proj.weight.T) * (x @ ffn.up_proj.weight.T)) @ ffn.down_proj.weight.T
    torch.testing.assert_close(ffn(x), expected, rtol=1e-5, atol=1e-6)


def test_stem_matches_formula(tiny_config):
    config = tiny_config("stem")
    ffn = StemFFN(config, layer_idx=1)
    _randomise(ffn)
    x, ids = _inputs(config)
    U = ffn.stem_embedding.weight
    expected = (_silu(x @ ffn.gate_proj.weight.T) * _rows_by_hand(U, ids)) @ ffn.down_proj.weight.T
    torch.testing.assert_close(ffn(x, TokenContext(ids)), expected, rtol=1e-5, atol=1e-6)
    assert not hasattr(ffn, "up_proj")  # the table replaces the up-projection


def test_stem_gate_matches_formula(tiny_config):
    config = tiny_config("stem_gate")
    ffn = StemGateFFN(config, layer_idx=1)
    _randomise(ffn)
    x, ids = _inputs(config)
    G = ffn.stem_embedding.weight
    expected = (_silu(_rows_by_hand(G, ids)) * (x @ ffn.up_proj.weight.T)) @ ffn.down_proj.weight.T
    torch.testing.assert_close(ffn(x, TokenContext(ids)), expected, rtol=1e-5, atol=1e-6)
    assert not hasattr(ffn, "gate_proj")


def test_ple_matches_formula(tiny_config):
    config = tiny_config("ple")
    ffn = PLEFFN(config, layer_idx=1)
    _randomise(ffn)
    x, ids = _inputs(config)
    dense = (_silu(x @ ffn.gate_proj.weight.T) * (x @ ffn.up_proj.weight.T)) @ ffn.down_proj.weight.T
    side = (_silu(x @ ffn.ple_gate.weight.T) * _rows_by_hand(ffn.ple_embedding.weight, ids)) @ ffn.ple_proj.weight.T
    torch.testing.assert_close(ffn(x, TokenContext(ids)), dense + side, rtol=1e-5, atol=1e-6)
    assert ffn.ple_embedding.weight.shape == (config.vocab_size, config.ple_dim)


@pytest.mark.parametrize("cls", [StemFFN, StemGateFFN, PLEFFN])
def test_lookup_follows_the_ids(tiny_config, cls):
    config = tiny_config()
    ffn = cls(config, layer_idx=1)
    _randomise(ffn)
    # The same hidden state at every position: only the ids can make rows differ.
    x = torch.randn(1, 1, config.hidden_size).expand(1, 6, -1).contiguous()
    ids = torch.tensor([[3, 9, 3, 200, 17, 9]])
    y = ffn(x, TokenContext(ids))
    torch.testing.assert_close(y[0, 0], y[0, 2])
    torch.testing.assert_close(y[0, 1], y[0, 5])
    assert not torch.allclose(y[0, 0], y[0, 1])
    perm = torch.tensor([4, 0, 5, 2, 1, 3])
    torch.testing.assert_close(ffn(x, TokenContext(ids[:, perm])), y[:, perm])


@pytest.mark.parametrize("cls", [StemFFN, StemGateFFN, PLEFFN])
def test_table_rows_override(tiny_config, cls):
    config = tiny_config()
    ffn = cls(config, layer_idx=2)
    _randomise(ffn)
    x, ids = _inputs(config)
    table = ffn.stem_embedding if hasattr(ffn, "stem_embedding") else ffn.ple_embedding
    calls = []

    def own_rows(layer_idx, input_ids):
        calls.append((layer_idx, input_ids))
        return table.weight[input_ids]

    y = ffn(x, TokenContext(ids))
    assert torch.equal(ffn(x, TokenContext(ids, rows={"token": own_rows})), y)
    assert calls[0][0] == 2 and torch.equal(calls[0][1], ids)
    # Other rows give another output: the override is really what the layer uses.
    other = ffn(x, TokenContext(ids, rows={"token": lambda i, t: torch.ones(*t.shape, table.embedding_dim)}))
    assert not torch.allclose(other, y)
    with pytest.raises(StemlmError, match=r"rows\['token'\] returned shape"):
        ffn(x, TokenContext(ids, rows={"token": lambda i, t: torch.ones(*t.shape, table.embedding_dim + 1)}))
