"""Tests of `value_embed_variant="reference"` (today's modded-nanogpt value embeddings): the forward in fp64 against
a plain-torch recomputation of the reference's semantics, as the FFN kind and beside STEM; KV-cache decoding against
the full forward; parameters against the meta model; FLOPs against FlopCounterMode; save/load (also through
AutoModelForCausalLM); the config checks; the start (gates 1, λ0 0.5) on every init path.

    OMP_NUM_THREADS=1 python -m pytest tests/model/test_value_embed_reference.py -q
"""

from __future__ import annotations

import pytest
import torch

from stemlm.errors import StemlmError
from stemlm.hf.configuration import StemlmConfig
from stemlm.hf.modeling import StemlmForCausalLM
from stemlm.model import build_model
from stemlm.model.accounting import parameter_counts, total_parameters
from stemlm.train.parallel.meta_init import init_plan, init_rank_part, materialise
from tests.model.round_trip import assert_flops_equal_flop_counter, assert_round_trip
from tests.model.test_accounting import math_attention

LAYERS = 8  # modded-nanogpt's pattern on 8 layers: None, ve0, ve1, None, None, ve2, ve3, ve4
SELECTION = "1,2,-3,-2,-1"


def config(tiny_config, beside=False, **extra):
    if beside:  # STEM on the odd layers, the value embeddings beside it
        fields = {"ffn_layers": "odd", "value_embed_layers": SELECTION}
        return tiny_config("stem", num_hidden_layers=LAYERS, value_embed_variant="reference", **fields, **extra)
    fields = {"ffn_layers": SELECTION, "value_embed_variant": "reference"}
    return tiny_config("value_embed", num_hidden_layers=LAYERS, **fields, **extra)


def randomized(model, seed=0):
    """fp64, every parameter random (λ0 and the gates included), so no term hides behind its start value."""
    model = model.to(torch.float64)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator, dtype=torch.float64) * 0.3
            p.copy_(1.0 + noise if name.endswith("norm.weight") or name.endswith("value_lambda") else noise)
    return model.eval()


def reference_pattern(num_layers):
    """modded-nanogpt's `ve = [None, ve[0], ve[1], *[None] * (num_layers - 6), ve[2], ve[3], ve[4]]`: table index
    per layer (the gates follow the same list)."""
    return [None, 0, 1, *[None] * (num_layers - 6), 2, 3, 4]


def recomputed(model, ids, module_of):
    """The logits of the model without its value embeddings (the twin with the same other weights), each of
    the five layers' v_proj output replaced in a forward hook by the reference's

        v + 2·sigmoid(W_g · [x[..., :6], ve[..., :6]]) per head · ve,     v scaled by sa_lambdas[0] = λ0

    with x the v_proj input (the normalised attention input), ve the layer's table at the ids: written from the
    reference's semantics against the unmodified attention."""
    cfg = model.config
    twin_cfg = cfg.replace(value_embed_layers="none") if cfg.ffn != "value_embed" else cfg.replace(ffn="dense")
    twin = build_model(twin_cfg).to(torch.float64).eval()
    twin.load_state_dict({k: v for k, v in model.state_dict().items() if "value_" not in k})
    H, D = cfg.kv_heads, cfg.head_size
    layers_with_tables = [i for i, t in enumerate(reference_pattern(cfg.num_hidden_layers)) if t is not None]
    handles = []
    for i in layers_with_tables:
        module = module_of(model, i)
        table, gate_w, lam = module.value_embedding.weight, module.value_gate.weight, module.value_lambda

        def hook(_module, inputs, v, table=table, gate_w=gate_w, lam=lam):
            x = inputs[0]  # [B, T, d]
            ve = table[ids]  # [B, T, H·D]
            gate_in = torch.cat([x[..., :6], ve[..., :6]], dim=-1)
            gate = 2 * torch.sigmoid(gate_in @ gate_w.T)  # [B, T, H]
            B, T, _ = ve.shape
            aux = (gate[..., None] * ve.view(B, T, H, D)).reshape(B, T, H * D)
            return lam[0] * v + aux

        handles.append(twin.model.layers[i].self_attn.v_proj.register_forward_hook(hook))
    with torch.no_grad():
        logits = twin(ids).logits
    for h in handles:
        h.remove()
    return logits


def ffn_module(model, i):
    return model.model.layers[i].mlp


def side_module(model, i):
    return model.model.layers[i].beside["value_embed"]


@pytest.mark.parametrize("beside", [False, True])
def test_forward_equals_the_reference_recomputed_in_fp64(tiny_config, beside):
    model = randomized(build_model(config(tiny_config, beside=beside)))
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(ids).logits
    expected = recomputed(model, ids, side_module if beside else ffn_module)
    assert float((got - expected).abs().max()) <= 1e-12
    # the gate matters: with the gates' weights zeroed (every gate 1) the logits move
    with torch.no_grad():
        for i in (1, 2, 5, 6, 7):
            (side_module if beside else ffn_module)(model, i).value_gate.weight.zero_()
        assert float((model(ids).logits - got).abs().max()) > 1e-3


def test_pattern_maps_the_five_tables_to_layers_1_2_and_the_last_three(tiny_config):
    model = build_model(config(tiny_config))
    assert model.config.special_layers == [1, 2, 5, 6, 7]
    assert sorted(model.token_tables()) == [1, 2, 5, 6, 7]  # five distinct tables, one per layer
    assert [i for i, t in enumerate(reference_pattern(LAYERS)) if t is not None] == [1, 2, 5, 6, 7]


@pytest.mark.parametrize("beside", [False, True])
def test_starts_as_the_reference_gates_one_and_lambda_half(tiny_config, beside):
    model = build_model(config(tiny_config, beside=beside), seed=3)
    for i in (1, 2, 5, 6, 7):
        module = (side_module if beside else ffn_module)(model, i)
        assert torch.equal(module.value_gate.weight, torch.zeros(model.config.kv_heads, 12))  # 2·sigmoid(0) = 1
        assert torch.equal(module.value_lambda.detach(), torch.tensor([0.5]))


@pytest.mark.parametrize("beside", [False, True])
def test_kv_cache_decoding_equals_full_forward(tiny_config, beside):
    model = randomized(build_model(config(tiny_config, beside=beside)))
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :4], use_cache=True)
        pieces, cache = [out.logits], out.past_key_values
        pieces.append(model(ids[:, 4:7], past_key_values=cache).logits)
        for t in range(7, 12):
            pieces.append(model(ids[:, t : t + 1], past_key_values=cache).logits)
    assert float((torch.cat(pieces, 1) - full).abs().max()) <= 1e-12


@pytest.mark.parametrize("beside", [False, True])
def test_parameters_equal_the_meta_model(tiny_config, beside):
    cfg = config(tiny_config, beside=beside)
    meta = build_model(cfg, device="meta")
    assert total_parameters(cfg) == sum(p.numel() for p in meta.parameters())
    counts = parameter_counts(cfg)
    width = cfg.kv_heads * cfg.head_size
    assert counts["value_gate"] == 5 * 12 * cfg.kv_heads
    assert counts["value_mix"] == 5
    assert counts["value_tables"] == 5 * 256 * width


def test_save_load(tmp_path, tiny_config):
    model = randomized(build_model(config(tiny_config)), seed=7).to(torch.float32)
    assert_round_trip(model, tmp_path / "ckpt", value_embed_variant="reference")


def test_config_checks(tiny_config):
    with pytest.raises(StemlmError, match="value_embed_variant must be one of stemlm, reference"):
        tiny_config("value_embed", num_hidden_layers=LAYERS, ffn_layers=SELECTION, value_embed_variant="modded")
    with pytest.raises(StemlmError, match="has 5 tables, one per layer: ffn_layers selects 4 layers"):
        tiny_config("value_embed", num_hidden_layers=LAYERS, ffn_layers="1,2,-2,-1", value_embed_variant="reference")
    with pytest.raises(StemlmError, match="value_embed_tables applies to value_embed_variant=stemlm only"):
        config(tiny_config, value_embed_tables=5)
    # the default stays the stemlm variant, and a model without value embeddings ignores the field
    assert tiny_config("value_embed").value_embed_variant == "stemlm"
    assert tiny_config("stem", value_embed_variant="reference").value_embed_variant == "reference"


def test_every_init_path_starts_lambda_at_half(tiny_config):
    """The meta init of `--nproc` (replaying `init_specs` on one rank) and Hugging Face's init honour the Fill."""
    cfg = config(tiny_config)
    built = build_model(cfg, seed=4)
    meta = build_model(cfg, device="meta")
    plan = init_plan(meta)
    materialise(meta, None, torch.device("cpu"))
    init_rank_part(meta, None, plan, seed=4)
    for (name, a), (_, b) in zip(built.state_dict().items(), meta.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    hf = StemlmForCausalLM(StemlmConfig.from_model_config(cfg))
    assert torch.equal(hf.stem.model.layers[1].mlp.value_lambda.detach(), torch.tensor([0.5]))


def test_flops_equal_flop_counter(tiny_config, monkeypatch):
    """The accounting's prefill and decode FLOPs against FlopCounterMode on real forwards (math attention)."""
    cfg = config(tiny_config, beside=True)
    model = build_model(cfg).eval()
    assert_flops_equal_flop_counter(model, monkeypatch, math_attention)
