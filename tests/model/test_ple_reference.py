"""Tests of `ple_variant="reference"` (Gemma-3n's per-layer input path) against transformers' Gemma-3n itself: the
per-layer inputs of `Gemma3nTextModel.project_per_layer_inputs` and the branch a `Gemma3nTextDecoderLayer` adds,
with weights copied over, to <= 1e-12 in fp64; the whole module against a recomputation of its formula; the
residual the decoder hands it; KV-cache decoding; parameters against the meta model; FLOPs against FlopCounterMode;
save/load (also through AutoModelForCausalLM); config checks.

Gemma-3n is built with its own config defaults (its RMSNorm eps 1e-6, not stemlm's rms_norm_eps). Gemma's RMSNorm
casts its input to fp32 whatever its dtype; the fp64 comparisons run it in the input's dtype (the
same formula without that cast), and one comparison runs it unchanged in fp32.

    OMP_NUM_THREADS=1 python -m pytest tests/model/test_ple_reference.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.gemma3n import modeling_gemma3n
from transformers.models.gemma3n.configuration_gemma3n import Gemma3nTextConfig

from stemlm.errors import StemlmError
from stemlm.model import build_model
from stemlm.model.accounting import parameter_counts, total_parameters
from stemlm.model.ffn import TokenContext
from tests.model.round_trip import assert_flops_equal_flop_counter, assert_round_trip
from tests.model.test_accounting import math_attention

LAYERS, P, D = 3, 16, 64


def config(tiny_config, **extra):
    return tiny_config("ple", **{"num_hidden_layers": LAYERS, "ffn_layers": "all", "ple_variant": "reference", **extra})


def randomized(model, seed=0, dtype=torch.float64):
    model = model.to(dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator, dtype=torch.float64).to(dtype) * 0.3
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    return model.eval()


def gemma(dtype):
    cfg = Gemma3nTextConfig(
        vocab_size=256,
        vocab_size_per_layer_input=256,
        hidden_size=D,
        hidden_size_per_layer_input=P,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        altup_num_inputs=2,
        altup_correct_scale=False,
        laurel_rank=8,
        num_kv_shared_layers=0,
        layer_types=["full_attention"] * LAYERS,
        activation_sparsity_pattern=[0.0] * LAYERS,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = modeling_gemma3n.Gemma3nTextModel(cfg).to(dtype).eval()
    with torch.no_grad():  # every weight random, norms near one, so no term hides behind its start value
        generator = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator, dtype=torch.float64).to(dtype) * 0.3
            p.copy_(1.0 + noise if "norm" in name else noise)
    # Gemma computes its 1/√2 buffer in fp32, which .to(fp64) keeps; in fp64 it is computed in fp64 here
    model.per_layer_input_scale = torch.rsqrt(torch.tensor(2.0, dtype=torch.float64)).to(dtype)
    return model


@pytest.fixture
def in_dtype_norm(monkeypatch):
    """Gemma's RMSNorm in its input's dtype: its formula without the cast to fp32."""

    def forward(self, hidden_states):
        normed = self._norm(hidden_states)
        return normed * self.weight if self.with_scale else normed

    monkeypatch.setattr(modeling_gemma3n.Gemma3nRMSNorm, "forward", forward)


def copy_from_gemma(module, reference, layer):
    """Layer `layer`'s PLE weights of Gemma into a stemlm PLEReferenceFFN."""
    rows = slice(layer * P, (layer + 1) * P)
    gemma_layer = reference.layers[layer]
    with torch.no_grad():
        module.ple_embedding.weight.copy_(reference.embed_tokens_per_layer.weight[:, rows])
        module.ple_model_proj.weight.copy_(reference.per_layer_model_projection.weight[rows])
        module.ple_input_norm.weight.copy_(reference.per_layer_projection_norm.weight)
        module.ple_gate.weight.copy_(gemma_layer.per_layer_input_gate.weight)
        module.ple_proj.weight.copy_(gemma_layer.per_layer_projection.weight)
        module.ple_post_norm.weight.copy_(gemma_layer.post_per_layer_input_norm.weight)


def test_per_layer_inputs_and_branch_equal_gemma3n_in_fp64(tiny_config, in_dtype_norm):
    reference = gemma(torch.float64)
    model = build_model(config(tiny_config)).to(torch.float64).eval()
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(2))
    embeds = reference.embed_tokens(ids)  # Gemma's scaled input embeddings, handed to both sides
    with torch.no_grad():
        expected = reference.project_per_layer_inputs(embeds, reference.get_per_layer_inputs(ids))  # [B, T, L, p]
        ctx = TokenContext(input_ids=ids, embeddings=embeds)
        for layer in range(LAYERS):
            module = model.model.layers[layer].mlp
            copy_from_gemma(module, reference, layer)
            got = module.per_layer_input(ctx)
            assert float((got - expected[:, :, layer]).abs().max()) <= 1e-12

            # The branch: Gemma's layer adds it to altup streams 1..n-1 only, so the difference of its outputs
            # with and without the per-layer input is the branch, and stream 0 is the output the gate reads.
            gemma_layer = reference.layers[layer]
            streams = torch.randn((2, *embeds.shape), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
            position_ids = torch.arange(ids.shape[1])[None]
            rope = reference.rotary_emb(embeds, position_ids, "full_attention")
            kwargs = {"position_embeddings": rope, "attention_mask": None, "position_ids": position_ids}
            with_input = gemma_layer(streams, per_layer_input=expected[:, :, layer], **kwargs)
            without = gemma_layer(streams, per_layer_input=torch.zeros_like(expected[:, :, layer]), **kwargs)
            branch = with_input[1] - without[1]
            assert float(branch.abs().max()) > 0.1
            assert torch.equal(with_input[0], without[0])  # stream 0 (the active one) does not get the branch
            mine = module.branch(with_input[0], got)
            assert float((mine - branch).abs().max()) <= 1e-12


def test_per_layer_inputs_equal_gemma3n_unchanged_in_fp32(tiny_config):
    """Gemma's own norm (fp32 always) against stemlm's in fp32: equal to float rounding."""
    reference = gemma(torch.float32)
    model = build_model(config(tiny_config)).eval()
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(2))
    embeds = reference.embed_tokens(ids)
    with torch.no_grad():
        expected = reference.project_per_layer_inputs(embeds, reference.get_per_layer_inputs(ids))
        for layer in range(LAYERS):
            module = model.model.layers[layer].mlp
            copy_from_gemma(module, reference, layer)
            got = module.per_layer_input(TokenContext(input_ids=ids, embeddings=embeds))
            torch.testing.assert_close(got, expected[:, :, layer], atol=1e-5, rtol=1e-5)


def rms(x, weight, eps):
    return x * (x.pow(2).mean(-1, keepdim=True) + eps) ** -0.5 * weight


def test_module_equals_its_formula_and_reads_the_residual(tiny_config):
    model = randomized(build_model(config(tiny_config, ffn_layers="1")))
    eps = 1e-6  # Gemma-3n's, whatever the backbone's rms_norm_eps
    assert model.config.rms_norm_eps != eps
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(4))
    seen = {}
    layer = model.model.layers[1]
    layer.mlp.register_forward_hook(lambda _m, args, out: seen.update(args=args, out=out))
    layer.self_attn.register_forward_hook(lambda _m, _args, out: seen.update(attn=out))
    layer.register_forward_pre_hook(lambda _m, args: seen.update(layer_input=args[0]))
    with torch.no_grad():
        model(ids)
        m = layer.mlp
        x, _, r = seen["args"]
        assert torch.equal(r, seen["layer_input"] + seen["attn"])  # the residual stream entering the FFN
        e = model.model.embed_tokens.weight[ids]
        dense = F.silu(x @ m.gate_proj.weight.T) * (x @ m.up_proj.weight.T) @ m.down_proj.weight.T
        u = rms(e @ m.ple_model_proj.weight.T / D**0.5, m.ple_input_norm.weight, eps)
        u = (u + P**0.5 * m.ple_embedding.weight[ids]) / 2**0.5
        g = F.gelu((r + dense) @ m.ple_gate.weight.T, approximate="tanh")
        expected = dense + rms((g * u) @ m.ple_proj.weight.T, m.ple_post_norm.weight, eps)
        assert float((seen["out"] - expected).abs().max()) <= 1e-12


def test_kv_cache_decoding_equals_full_forward(tiny_config):
    model = randomized(build_model(config(tiny_config)))
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :4], use_cache=True)
        pieces, cache = [out.logits], out.past_key_values
        pieces.append(model(ids[:, 4:6], past_key_values=cache).logits)
        for t in range(6, 10):
            pieces.append(model(ids[:, t : t + 1], past_key_values=cache).logits)
    assert float((torch.cat(pieces, 1) - full).abs().max()) <= 1e-12


def test_parameters_equal_the_meta_model(tiny_config):
    cfg = config(tiny_config, ffn_layers="odd", num_hidden_layers=4)
    meta = build_model(cfg, device="meta")
    assert total_parameters(cfg) == sum(p.numel() for p in meta.parameters())
    assert parameter_counts(cfg)["ple_tables"] == 2 * 256 * P


def test_save_load(tmp_path, tiny_config):
    model = randomized(build_model(config(tiny_config)), seed=7, dtype=torch.float32)
    assert_round_trip(model, tmp_path / "ckpt", ple_variant="reference")


def test_config_checks(tiny_config):
    with pytest.raises(StemlmError, match="ple_variant must be one of stemlm, reference"):
        tiny_config("ple", ple_variant="gemma")
    assert tiny_config("ple").ple_variant == "stemlm"


def test_flops_equal_flop_counter(tiny_config, monkeypatch):
    """The accounting's prefill and decode FLOPs against FlopCounterMode on real forwards (math attention)."""
    cfg = config(tiny_config, ffn_layers="odd", num_hidden_layers=4)
    model = build_model(cfg).eval()
    assert_flops_equal_flop_counter(model, monkeypatch, math_attention)
