"""Attribution: gradient x input against a finite difference, FFN norms against a direct computation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stemlm.analysis.attribution import attribute, plot_attribution
from stemlm.analysis.spread import ffn_inputs
from stemlm.errors import StemlmError


def _logp_with_scaled_row(model, ids, token, layer, pos, alpha):
    tables = model.token_tables()

    def rows(layer_idx, input_ids):
        r = tables[layer_idx](input_ids)
        if layer_idx == layer:
            r = r.clone()
            r[:, pos] *= alpha
        return r

    with torch.no_grad():
        logits = model(torch.tensor([ids]), rows={"token": rows}).logits[0, -1].double()
    return float(logits.log_softmax(-1)[token])


def test_grad_x_input_is_the_derivative_of_scaling_the_row(analysis_model):
    model = analysis_model(seed=3)
    with torch.no_grad():
        for t in model.token_tables().values():
            t.weight.mul_(20)  # rows large enough that the effect is well above float noise
    ids = [5, 77, 130, 9, 44]
    result = attribute(model, ids, token_id=200)
    h = 1e-3
    for layer in (1, 2):
        for pos in (1, 4):
            up = _logp_with_scaled_row(model, ids, 200, layer, pos, 1 + h)
            down = _logp_with_scaled_row(model, ids, 200, layer, pos, 1 - h)
            assert result["layers"][str(layer)]["grad_x_input"][pos] == pytest.approx((up - down) / (2 * h), abs=2e-3)
    assert all(p.grad is None for p in model.parameters())


def test_ffn_norm_and_default_token(analysis_model, tmp_path):
    model = analysis_model()
    ids = [5, 77, 130, 9]
    result = attribute(model, ids)
    with torch.no_grad():
        assert result["token_id"] == int(model(torch.tensor([ids])).logits[0, -1].argmax())
        inputs = ffn_inputs(model, ids)
        for layer in (1, 2):
            mlp = model.model.layers[layer].mlp
            out = mlp.down_proj(F.silu(mlp.gate_proj(inputs[layer])) * mlp.stem_embedding.weight[ids])
            torch.testing.assert_close(torch.tensor(result["layers"][str(layer)]["ffn_norm"]), out.norm(dim=-1))
    png = plot_attribution(result, ["a", "b", "c", "d"], "x", tmp_path / "a.png")
    assert png.stat().st_size > 1000


def test_attribution_errors(analysis_model):
    with pytest.raises(StemlmError, match="needs a STEM model"):
        attribute(analysis_model("dense"), [1, 2])
    with pytest.raises(StemlmError, match="outside the vocabulary"):
        attribute(analysis_model(), [1, 2], token_id=10_000)
