"""Tests of the decoder (`stemlm.model.decoder`): input checks, the loss, `rows` plumbing, initialisation,
meta-device builds, low-precision forwards, and (slow) logit parity of a dense model with HF Llama."""

from __future__ import annotations

import math

import pytest
import torch

from stemlm.errors import StemlmError
from stemlm.model import build_model
from stemlm.model.config import FFN_KINDS, TABLE_KINDS
from stemlm.model.decoder import ForwardOptions


@pytest.mark.parametrize("bad", [-1, 256, 1000])
def test_out_of_range_ids_name_the_id(tiny_model, bad):
    model = tiny_model("stem")
    ids = torch.tensor([[1, 2, bad]])
    with pytest.raises(StemlmError, match=rf"token id {bad} .*vocab_size 256"):
        model(ids)


def test_bad_id_tensors_are_rejected(tiny_model):
    model = tiny_model("dense")
    with pytest.raises(StemlmError, match="integer tensor"):
        model(torch.tensor([[1.0, 2.0]]))
    with pytest.raises(StemlmError, match=r"\[batch, seq_len\]"):
        model(torch.tensor([1, 2]))


@pytest.mark.parametrize("ffn", ["stem", "hash_moe"])
def test_narrow_integer_ids_work(tiny_model, ffn):
    model = tiny_model(ffn)
    ids = torch.randint(0, 256, (2, 5))
    with torch.no_grad():
        expected = model(ids).logits
        for dtype in (torch.uint8, torch.int16, torch.int32):
            assert torch.equal(model(ids.to(dtype)).logits, expected)


def test_loss_is_cross_entropy_on_given_targets(tiny_model):
    model = tiny_model("stem")
    ids = torch.randint(0, 256, (2, 6))
    labels = torch.randint(0, 256, (2, 6))
    labels[0, 2] = -100
    with torch.no_grad():
        out = model(ids, labels=labels)
    logp = out.logits.double().log_softmax(-1)
    terms = [-logp[b, t, labels[b, t]] for b in range(2) for t in range(6) if labels[b, t] != -100]
    assert float(out.loss) == pytest.approx(float(sum(terms) / len(terms)), rel=1e-5)
    assert torch.equal(out.logits, model(ids).logits)  # labels never change the logits
    with pytest.raises(StemlmError, match="label 300 is out of range"):
        model(ids, labels=torch.full((2, 6), 300))
    with pytest.raises(StemlmError, match="labels has shape"):
        model(ids, labels=labels[:, :5])


@pytest.mark.parametrize("ffn", TABLE_KINDS)
def test_table_rows_sees_input_ids_and_own_rows_change_nothing(tiny_model, ffn):
    model = tiny_model(ffn)
    tables = model.token_tables()
    assert sorted(tables) == model.config.special_layers
    ids = torch.randint(0, 256, (2, 7))
    seen = []

    def own(layer_idx, input_ids):
        seen.append(layer_idx)
        assert torch.equal(input_ids, ids)
        return tables[layer_idx](input_ids)

    with torch.no_grad():
        assert torch.equal(model(ids, labels=ids.roll(1, 1), rows={"token": own}).logits, model(ids).logits)
    assert seen == model.config.special_layers


def test_token_tables_empty_without_tables(tiny_model):
    for ffn in set(FFN_KINDS) - set(TABLE_KINDS):
        assert tiny_model(ffn).token_tables() == {}


def test_sequence_longer_than_max_positions(tiny_model):
    model = tiny_model("dense", max_position_embeddings=8)
    with pytest.raises(StemlmError, match="max_position_embeddings=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def _std(t: torch.Tensor) -> float:
    return float(t.detach().double().std())


def test_init_follows_table_init(tiny_config):
    model = build_model(tiny_config("stem", ffn_layers="all"))
    V, d_ff = model.config.vocab_size, model.config.intermediate_size
    for table in model.token_tables().values():
        assert _std(table.weight) == pytest.approx(math.sqrt(2 / (V + d_ff)), rel=0.03)
        assert abs(float(table.weight.detach().double().mean())) < 0.003
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p))
        elif "stem_embedding" not in name:
            assert _std(p) == pytest.approx(model.config.initializer_range, rel=0.05), name
    normal = build_model(tiny_config("ple", table_init="normal", table_init_std=0.05))
    for table in normal.token_tables().values():
        assert _std(table.weight) == pytest.approx(0.05, rel=0.05)


def test_seed_gives_identical_weights(tiny_config):
    config = tiny_config("moe")
    a, b, c = build_model(config, seed=5), build_model(config, seed=5), build_model(config, seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])


def test_meta_build_and_tied_weights(tiny_config):
    meta = build_model(tiny_config("stem", tie_word_embeddings=True), device="meta")
    assert all(p.is_meta for p in meta.parameters())
    real = build_model(tiny_config("stem", tie_word_embeddings=True))
    assert real.lm_head.weight is real.model.embed_tokens.weight
    assert real.num_parameters() == meta.num_parameters()
    untied = build_model(tiny_config("stem"))
    assert untied.num_parameters() == real.num_parameters() + 256 * 64


@pytest.mark.parametrize("ffn", FFN_KINDS)
def test_bf16_and_autocast_forward(tiny_model, ffn):
    model = tiny_model(ffn, initializer_range=0.1)
    ids = torch.randint(0, 256, (2, 6))
    with torch.no_grad():
        ref = model(ids, labels=ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = model(ids, labels=ids)
        half = model.to(torch.bfloat16)(ids, labels=ids)
    scale = float(ref.abs().max())
    for out in (auto, half):
        assert torch.isfinite(out.loss)
        # bf16 keeps ~3 significant digits; errors of a few percent of the logit scale are expected.
        assert float((out.logits.float() - ref).abs().max()) < 0.1 * scale
    assert half.logits.dtype == torch.bfloat16


@pytest.mark.slow
def test_dense_matches_hf_llama(tiny_model):
    transformers = pytest.importorskip("transformers")
    model = tiny_model("dense", tie_word_embeddings=False)
    fields = {k: v for k, v in model.config.to_hf_dict().items() if k not in ("model_type", "architectures")}
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).eval()
    hf.load_state_dict(model.state_dict(), strict=True)
    ids = torch.randint(0, 256, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, rtol=1e-5, atol=1e-5)
        ours, theirs = model(ids, attention_mask=mask).logits, hf(ids, attention_mask=mask).logits
    torch.testing.assert_close(ours[mask.bool()], theirs[mask.bool()], rtol=1e-5, atol=1e-5)


def test_last_logits_are_the_last_positions_logits(tiny_model):
    model = tiny_model("stem")
    ids = torch.tensor([[5, 17, 3, 42], [9, 8, 7, 6]])
    with torch.no_grad():
        full = model(ids).logits
        last = model(ids, options=ForwardOptions(last_logits=True)).logits
    assert last.shape == (2, 1, full.shape[-1])
    torch.testing.assert_close(last, full[:, -1:], rtol=0, atol=1e-5)
