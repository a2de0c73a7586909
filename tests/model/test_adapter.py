"""Tests of the retrofit adapter FFN (`stem_adapter`, stemlm.model.kinds.stem_adapter) and
`stemlm.convert.retrofit.adapter_from`.

Independent checks: the layer equals its formula written out; a fresh one starts with blend sigmoid(-4);
with the gate saturated shut the adapter model has the dense model's logits, saturated open the plain STEM
retrofit's; `--train tables` trains the tables and the gate logits, nothing else."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stemlm.convert.retrofit import adapter_from, retrofit
from stemlm.model import TokenContext, build_model
from stemlm.model.kinds.stem_adapter import GATE_BIAS
from stemlm.train.optim import freeze_backbone
from tests.conftest import make_tiny_config, make_tiny_model


def test_layer_is_its_formula():
    model = build_model(make_tiny_config("stem_adapter", ffn_layers="1"), seed=3)
    mlp = model.model.layers[1].mlp
    assert torch.equal(mlp.adapter_gate, torch.zeros_like(mlp.adapter_gate))
    assert torch.allclose(mlp.blend(), torch.sigmoid(torch.tensor(GATE_BIAS)).expand_as(mlp.blend()))
    with torch.no_grad():
        mlp.adapter_gate.copy_(torch.randn_like(mlp.adapter_gate) * 3)
    x, ids = torch.randn(2, 5, 64), torch.randint(0, 256, (2, 5))
    g = torch.sigmoid(mlp.adapter_gate + GATE_BIAS)
    up = (1 - g) * (x @ mlp.up_proj.weight.t()) + g * mlp.stem_embedding.weight[ids]
    expected = (F.silu(x @ mlp.gate_proj.weight.t()) * up) @ mlp.down_proj.weight.t()
    torch.testing.assert_close(mlp(x, TokenContext(input_ids=ids)), expected)
    assert sorted(model.token_tables()) == [1]


def test_adapter_interpolates_between_dense_and_retrofit():
    dense = make_tiny_model("dense")
    stem = retrofit(dense, "0,2", "normed").eval()
    adapter = adapter_from(dense, stem).eval()
    assert adapter.config.ffn == "stem_adapter" and sorted(adapter.token_tables()) == [0, 2]
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for i in (0, 2):
            adapter.model.layers[i].mlp.adapter_gate.fill_(-100.0)
        torch.testing.assert_close(adapter(ids).logits, dense(ids).logits)
        for i in (0, 2):
            adapter.model.layers[i].mlp.adapter_gate.fill_(100.0)
        torch.testing.assert_close(adapter(ids).logits, stem(ids).logits, atol=1e-5, rtol=1e-5)


def test_train_tables_keeps_the_gate_trainable():
    model = build_model(make_tiny_config("stem_adapter", ffn_layers="1"), seed=0)
    freeze_backbone(model)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"model.layers.1.mlp.stem_embedding.weight", "model.layers.1.mlp.adapter_gate"}
