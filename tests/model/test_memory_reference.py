"""`memory_variant="reference"`: facebookresearch/memory's product-key memory (`HashingMemory` with its defaults).

The recomputation below is written from the reference's semantics in plain torch, one position and one head at a
time, with the top-k taken over all n² product keys at once (the reference's two-stage top-k returns the same k
best whenever they are distinct): query W_q x + b_q split into halves, sub-key scores, the k best product keys,
softmax over their scores (in fp32, as the reference's `scores.float()` does for any dtype), the weighted sum of
their value rows, then value_proj(m ⊙ silu(swilu_projection(x))) with both biases; one value table for every
memory layer. Also: the inits, KV-cache decoding, accounting against the meta model, save/load and the default
variant's parameters.

    OMP_NUM_THREADS=1 python -m pytest tests/model/test_memory_reference.py -q
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from stemlm.checkpoint.folder import save_pretrained
from stemlm.checkpoint.runs import from_pretrained
from stemlm.errors import StemlmError
from stemlm.model import accounting as acc
from stemlm.model import build_model
from stemlm.model.config import ModelConfig
from stemlm.model.decoder import StemLM
from stemlm.model.ffn import TokenContext

H, DK, N, K, D = 2, 16, 16, 4, 64
SMALL = dict(memory_keys=N, memory_topk=K, memory_heads=H, memory_key_dim=DK)


def config(tiny_config, variant="reference", **kw):
    return tiny_config("memory", num_hidden_layers=4, ffn_layers="1,3", memory_variant=variant, **{**SMALL, **kw})


def randomized(model, scale=0.5):
    with torch.no_grad():  # every parameter nonzero and the biases large, so each term shows in the output
        for p in model.parameters():
            p.normal_(0, scale, generator=torch.Generator().manual_seed(p.numel()))
    return model


def recompute(mlp, x: torch.Tensor) -> tuple[torch.Tensor, list[list[int]]]:
    """The reference's output for positions x [T, d] and the value ids each position reads (head by head)."""
    Wq, bq = mlp.memory_query.weight, mlp.memory_query.bias
    keys, values = mlp.memory_keys, mlp.memory_values.weight  # keys [heads, 2, n, dk/2]
    out, chosen = [], []
    for t in range(x.shape[0]):
        query = Wq @ x[t] + bq
        memory, ids = torch.zeros_like(x[t]), []
        for h in range(H):
            q = query[h * DK : (h + 1) * DK]
            s1, s2 = keys[h, 0] @ q[: DK // 2], keys[h, 1] @ q[DK // 2 :]
            product = (s1[:, None] + s2[None, :]).flatten()  # score of value row i·n + j
            best, idx = product.topk(K)
            weights = torch.softmax(best.float(), dim=0).to(best.dtype)  # the reference's softmax runs in fp32
            memory = memory + (weights[:, None] * values[idx]).sum(0)
            ids.extend(idx.tolist())
        gate = F.silu(mlp.memory_gate.weight @ x[t] + mlp.memory_gate.bias)
        out.append(mlp.memory_out.weight @ (memory * gate) + mlp.memory_out.bias)
        chosen.append(ids)
    return torch.stack(out), chosen


def test_reference_variant_equals_an_independent_recomputation_in_fp64(tiny_config):
    model = randomized(build_model(config(tiny_config))).double()
    x = torch.randn(7, D, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    for layer in (1, 3):
        mlp = model.model.layers[layer].mlp
        with torch.no_grad():
            out = mlp(x[None], TokenContext(input_ids=torch.zeros(1, 7, dtype=torch.long)))[0]
            ids, _ = mlp.select(x)
            expected, chosen = recompute(mlp, x)
        assert ids.tolist() == chosen  # the same value rows, in the same order
        assert (out - expected).abs().max().item() <= 1e-12


def test_whole_model_equals_the_recomputation_through_every_layer(tiny_config):
    model = randomized(build_model(config(tiny_config)), scale=0.2).double().eval()
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(5))
    seen = {}
    for i in (1, 3):
        model.model.layers[i].mlp.register_forward_hook(lambda m, a, o, i=i: seen.update({i: (a[0][0], o[0])}))
    with torch.no_grad():
        model(ids)
        for i in (1, 3):
            x, y = seen[i]
            assert (y - recompute(model.model.layers[i].mlp, x)[0]).abs().max().item() <= 1e-12


def test_one_value_table_shared_by_every_memory_layer(tiny_config):
    model = build_model(config(tiny_config))
    first, second = model.model.layers[1].mlp, model.model.layers[3].mlp
    assert second.memory_values is first.memory_values and second.table_key == 1
    names = [name for name, _ in model.named_parameters() if "memory_values" in name]
    assert names == ["model.layers.1.mlp.memory_values.weight"]
    assert list(model.tables("memory")) == [1]
    own = build_model(config(tiny_config, "stemlm"))
    assert list(own.tables("memory")) == [1, 3]
    assert not any(
        p.endswith("bias") for p, _ in own.named_parameters()
    )  # the default variant is as it was: no biases, a table per layer


def test_reference_inits(tiny_config):
    cfg = config(tiny_config, memory_keys=64, memory_key_dim=64, memory_heads=4)
    mlp = build_model(cfg, seed=3).model.layers[1].mlp
    d, dk = D, 64

    def uniform(param, bound):
        assert param.abs().max().item() <= bound
        assert param.abs().max().item() > 0.9 * bound  # spread over the whole interval
        assert abs(param.float().var().item() - bound**2 / 3) < 0.15 * bound**2 / 3

    def normal(param, std):
        assert abs(param.float().std().item() - std) < 0.05 * std
        assert param.abs().max().item() > 2.5 * std  # not a uniform of that std (whose max is 1.73 std)

    uniform(mlp.memory_keys, 1 / math.sqrt(dk))
    uniform(mlp.memory_query.weight, math.sqrt(6 / (d + 4 * dk)))
    for bias in (mlp.memory_query.bias, mlp.memory_gate.bias, mlp.memory_out.bias):
        uniform(bias, 1 / math.sqrt(d))
    for weight in (mlp.memory_values.weight, mlp.memory_gate.weight, mlp.memory_out.weight):
        normal(weight, d**-0.5)


def test_kv_cache_decoding_equals_the_full_forward(tiny_config):
    model = randomized(build_model(config(tiny_config)), scale=0.1).double().eval()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :7], use_cache=True)
        steps = [out.logits]
        for t in range(7, 12):
            out = model(ids[:, t : t + 1], past_key_values=out.past_key_values)
            steps.append(out.logits)
    assert (torch.cat(steps, dim=1) - full).abs().max().item() <= 1e-12


def test_parameter_counts_match_the_meta_model_with_the_table_once(tiny_config):
    for variant in ("stemlm", "reference"):
        cfg = config(tiny_config, variant)
        model = build_model(cfg, device="meta")
        counts = acc.parameter_counts(cfg)
        assert sum(counts.values()) == model.num_parameters()
        values = sum(p.numel() for name, p in model.named_parameters() if "memory_values" in name)
        assert counts["memory_values"] == values == (1 if variant == "reference" else 2) * N * N * D
        proj = sum(p.numel() for n, p in model.named_parameters() if ".mlp.memory_" in n and "values" not in n)
        assert counts["memory_proj"] == proj


def test_save_and_load_keep_the_shared_table(tiny_config, tmp_path):
    model = randomized(build_model(config(tiny_config)), scale=0.1).eval()
    folder = save_pretrained(model, tmp_path / "ckpt")
    loaded = from_pretrained(folder).eval()
    assert loaded.config.memory_variant == "reference"
    assert loaded.model.layers[3].mlp.memory_values is loaded.model.layers[1].mlp.memory_values
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()  # transformers' loader ties the shared table too
    assert hf.config.memory_variant == "reference"
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_an_unknown_variant_is_refused(tiny_config):
    with pytest.raises(StemlmError, match="memory_variant='paper' is not one of stemlm, reference"):
        ModelConfig(**{**config(tiny_config).to_dict(), "memory_variant": "paper"})


def test_the_multi_process_meta_init_draws_the_same_uniforms(tiny_config):
    from stemlm.train.parallel.meta_init import init_plan, init_rank_part, materialise

    cfg = config(tiny_config)
    expected = build_model(cfg, seed=5)
    with torch.device("meta"):
        model = StemLM(cfg)
    plan = init_plan(model)
    materialise(model, None, torch.device("cpu"))
    init_rank_part(model, None, plan, seed=5)  # the row-block draws of `stemlm train --nproc`
    for (name, p), q in zip(model.named_parameters(), expected.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert model.model.layers[3].mlp.memory_values is model.model.layers[1].mlp.memory_values


def test_transformers_init_draws_the_reference_uniforms(tiny_config):
    from stemlm.hf import StemlmConfig, StemlmForCausalLM

    hf = StemlmForCausalLM(StemlmConfig.from_model_config(config(tiny_config)))  # HF's _init_weights path
    mlp = hf.stem.model.layers[1].mlp
    bound = D**-0.5
    for bias in (mlp.memory_query.bias, mlp.memory_gate.bias, mlp.memory_out.bias):
        assert 0.8 * bound < bias.abs().max().item() <= bound
    assert 0.8 * DK**-0.5 < mlp.memory_keys.abs().max().item() <= DK**-0.5
