"""Tests of the transformers conventions of `StemlmForCausalLM` (issue 24): the config's special token ids and
`use_cache`, `generate()` stopping on EOS, `output_hidden_states` / `output_attentions` (checked against HF Llama
on a dense folder), `return_dict=False`, `inputs_embeds`, gradient checkpointing and the base model
(`StemlmModel`). Tiny configs; run with `OMP_NUM_THREADS=1 python -m pytest tests/hf/test_hf_outputs.py -q -x`.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, DynamicCache, LlamaForCausalLM
from transformers.modeling_layers import GradientCheckpointingLayer

from stemlm.errors import StemlmError
from stemlm.hf import StemlmConfig, StemlmModel
from tests.hf.test_hf import random_ids, saved_stemlm, tiny_config


def loaded(tmp_path, kind: str, **config_json):
    """A random stemlm folder of `kind` (with `config_json` merged into its config.json), loaded through HF."""
    model, folder = saved_stemlm(tmp_path, tiny_config(kind))
    if config_json:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config_json}))
    return model, folder, AutoModelForCausalLM.from_pretrained(folder).eval()


# ----------------------------------------------------------------------------------------------------------
# config: special token ids and use_cache
# ----------------------------------------------------------------------------------------------------------
def test_config_declares_token_ids_and_use_cache(tmp_path):
    _, folder = saved_stemlm(tmp_path, tiny_config("stem"))
    assert "eos_token_id" not in json.loads((folder / "config.json").read_text())  # a stemlm folder lacks them
    config = AutoConfig.from_pretrained(folder)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id, config.use_cache) == (None, None, None, True)
    StemlmConfig(**{**config.to_dict(), "eos_token_id": 5, "bos_token_id": 1, "pad_token_id": 0}).save_pretrained(
        tmp_path / "hf"
    )
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (saved["bos_token_id"], saved["eos_token_id"], saved["pad_token_id"]) == (1, 5, 0)
    again = AutoConfig.from_pretrained(tmp_path / "hf", use_cache=False)
    assert (again.bos_token_id, again.eos_token_id, again.pad_token_id, again.use_cache) == (1, 5, 0, False)
    assert again.to_model_config() == config.to_model_config()


@pytest.mark.parametrize("kind", ["stem", "dense"])
def test_generate_stops_on_eos_from_config_json(tmp_path, kind):
    _, _, hf = loaded(tmp_path, kind)
    ids = random_ids(1, 5, seed=11)
    free = hf.generate(ids, max_new_tokens=10, do_sample=False)[0, 5:].tolist()
    eos = free[3]
    stop = free.index(eos)  # its first occurrence
    _, _, hf = loaded(tmp_path / "eos", kind, eos_token_id=eos)
    stopped = hf.generate(ids, max_new_tokens=10, do_sample=False)[0, 5:].tolist()
    assert stopped == free[: stop + 1]


# ----------------------------------------------------------------------------------------------------------
# output_hidden_states / output_attentions
# ----------------------------------------------------------------------------------------------------------
def test_hidden_states_and_attentions_match_llama(tmp_path):
    _, folder, hf = loaded(tmp_path, "dense")
    llama = LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    ids = random_ids(2, 9, seed=12)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding, so the masked path of the math attention is compared too
    ours = hf(ids, attention_mask=mask, output_hidden_states=True, output_attentions=True)
    theirs = llama(ids, attention_mask=mask, output_hidden_states=True, output_attentions=True)
    assert len(ours.hidden_states) == len(theirs.hidden_states) == 4  # embeddings + one per layer
    assert len(ours.attentions) == len(theirs.attentions) == 3
    # Compared where tokens are real: a fully padded query row sees only itself here, nothing in Llama.
    real = mask.bool()
    for a, b in zip(ours.hidden_states, theirs.hidden_states, strict=True):
        torch.testing.assert_close(a[real], b[real], atol=1e-5, rtol=0)
    for a, b in zip(ours.attentions, theirs.attentions, strict=True):
        torch.testing.assert_close(a[:, :, 3:], b[:, :, 3:], atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.logits[real], theirs.logits[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["stem", "engram", "value_embed", "moe"])
def test_hidden_states_layout_and_default_path_unchanged(tmp_path, kind):
    _, _, hf = loaded(tmp_path, kind)
    ids = random_ids(2, 8, seed=13)
    layer_outputs = []
    for layer in hf.model.layers:
        layer.register_forward_hook(lambda module, args, out: layer_outputs.append(out))
    default = hf(ids).logits
    layer_outputs.clear()
    out = hf(ids, output_hidden_states=True)
    assert torch.equal(out.logits, default)  # hidden states alone keep SDPA: bitwise the default forward
    assert out.attentions is None
    hidden = out.hidden_states
    assert torch.equal(hidden[0], hf.model.embed_tokens(ids))
    for got, layer_out in zip(hidden[1:-1], layer_outputs[:-1], strict=True):
        assert torch.equal(got, layer_out)
    assert torch.equal(hidden[-1], hf.model.norm(layer_outputs[-1]))  # the last one after the final norm
    assert torch.equal(hf.lm_head(hidden[-1]), default)


@pytest.mark.parametrize("kind", ["stem", "stem_ngram", "value_embed"])
def test_attentions_with_a_cache_and_from_the_config(tmp_path, kind):
    _, folder, hf = loaded(tmp_path, kind)
    ids = random_ids(2, 7, seed=14)
    reference = hf(ids).logits
    first = hf(ids[:, :4], use_cache=True)
    step = hf(ids[:, 4:], cache=first.cache, output_attentions=True)
    torch.testing.assert_close(step.logits, reference[:, 4:], atol=1e-5, rtol=0)
    weights = step.attentions[1]
    assert weights.shape == (2, 4, 3, 7)
    assert torch.all(weights[:, :, 0, 5:] == 0) and torch.all(weights[:, :, 1, 6:] == 0)  # causal over the cache
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 3), atol=1e-6, rtol=0)
    configured = AutoModelForCausalLM.from_pretrained(folder, output_attentions=True, output_hidden_states=True)
    out = configured(ids)
    assert len(out.attentions) == 3 and len(out.hidden_states) == 4
    torch.testing.assert_close(out.logits, reference, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------------------------
# return_dict, use_cache, inputs_embeds
# ----------------------------------------------------------------------------------------------------------
def test_return_dict_false_and_use_cache_from_config(tmp_path):
    _, folder, hf = loaded(tmp_path, "moe")
    ids = random_ids(1, 6, seed=15)
    out = hf(ids, labels=ids)
    assert isinstance(out.cache, DynamicCache) and out.cache.get_seq_length() == 6  # config.use_cache is True
    as_tuple = hf(ids, labels=ids, return_dict=False)
    assert isinstance(as_tuple, tuple) and len(as_tuple) == 4  # loss, logits, cache, aux_loss
    assert torch.equal(as_tuple[0], out.loss) and torch.equal(as_tuple[1], out.logits)
    no_cache = AutoModelForCausalLM.from_pretrained(folder, use_cache=False, return_dict=False)
    loss, logits, aux = no_cache(ids, labels=ids)
    assert torch.equal(logits, out.logits) and torch.equal(aux, out.aux_loss)
    assert no_cache(ids, use_cache=True, return_dict=True).cache is not None  # the keyword wins


@pytest.mark.parametrize("kind", ["dense", "moe", "memory"])
def test_inputs_embeds_for_kinds_that_do_not_read_ids(tmp_path, kind):
    _, _, hf = loaded(tmp_path, kind)
    ids = random_ids(2, 6, seed=16)
    embeds = hf.model.embed_tokens(ids)
    assert torch.equal(hf(inputs_embeds=embeds).logits, hf(ids).logits)
    generated = hf.generate(inputs_embeds=embeds, max_new_tokens=4, do_sample=False)
    assert torch.equal(generated, hf.generate(ids, max_new_tokens=4, do_sample=False)[:, 6:])


@pytest.mark.parametrize("kind", ["stem", "hash_moe", "engram"])
def test_inputs_embeds_needs_input_ids_for_kinds_that_read_them(tmp_path, kind):
    _, _, hf = loaded(tmp_path, kind)
    ids = random_ids(2, 6, seed=17)
    embeds = hf.model.embed_tokens(ids)
    with pytest.raises(StemlmError, match=f"ffn={kind} reads the token ids"):
        hf(inputs_embeds=embeds)
    # With the ids given too, the embeddings replace embed_tokens while the tables still read the ids.
    assert torch.equal(hf(ids, inputs_embeds=embeds).logits, hf(ids).logits)
    assert not torch.allclose(hf(ids, inputs_embeds=embeds * 2).logits, hf(ids).logits)


# ----------------------------------------------------------------------------------------------------------
# gradient checkpointing
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["activation_checkpointing", "gradient_checkpointing"])  # 5.x name, deprecated one
@pytest.mark.parametrize("kind", ["stem", "moe"])
def test_gradient_checkpointing_gives_the_same_gradients(tmp_path, kind, name):
    _, _, hf = loaded(tmp_path, kind)
    hf.train()
    ids = random_ids(2, 8, seed=18)
    calls = []
    # A module inside the layer: the checkpointed layer runs its forward (and so this) again in the backward pass.
    hf.model.layers[1].self_attn.register_forward_pre_hook(lambda module, args: calls.append(1))

    def gradients():
        hf.zero_grad()
        hf(ids, labels=ids).loss.backward()
        return {name: p.grad.clone() for name, p in hf.named_parameters() if p.grad is not None}

    plain = gradients()
    assert len(calls) == 1 and not hf.is_activation_checkpointing
    assert all(isinstance(layer, GradientCheckpointingLayer) for layer in hf.model.layers)
    getattr(hf, f"{name}_enable")()
    assert hf.is_activation_checkpointing and all(layer.gradient_checkpointing for layer in hf.model.layers)
    calls.clear()
    checkpointed = gradients()
    assert len(calls) == 2  # the layer ran again in the backward pass
    assert plain.keys() == checkpointed.keys()
    for key in plain:
        torch.testing.assert_close(checkpointed[key], plain[key], atol=1e-6, rtol=0, msg=key)
    assert hf(ids, labels=ids).cache is None  # no cache while checkpointing a training forward
    getattr(hf, f"{name}_disable")()
    assert not hf.is_activation_checkpointing and not any(layer.gradient_checkpointing for layer in hf.model.layers)
    calls.clear()
    gradients()
    assert len(calls) == 1


# ----------------------------------------------------------------------------------------------------------
# the base model
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["stem", "dense"])
def test_base_model_is_a_pretrained_model_sharing_the_weights(tmp_path, kind):
    _, folder, hf = loaded(tmp_path, kind)
    assert isinstance(hf.base_model, StemlmModel) and hf.base_model is hf.model
    assert {n for n, _ in hf.named_parameters()} == {f"model.{n}" for n, _ in hf.model.named_parameters()} | (
        {"lm_head.weight"}
    )
    ids = random_ids(2, 6, seed=19)
    full = hf(ids, output_hidden_states=True)
    base = AutoModel.from_pretrained(folder).eval()  # a causal-LM folder loads into the base model
    assert isinstance(base, StemlmModel)
    out = base(ids, output_hidden_states=True)
    assert torch.equal(out.last_hidden_state, full.hidden_states[-1])
    assert len(out.hidden_states) == 4 and isinstance(out.cache, DynamicCache)
    assert torch.equal(base(ids, return_dict=False)[0], out.last_hidden_state)
    base.save_pretrained(tmp_path / "base")  # and a base-model folder loads into the causal LM, all but the head
    again, info = AutoModelForCausalLM.from_pretrained(tmp_path / "base", output_loading_info=True)
    assert info["missing_keys"] == {"lm_head.weight"}
    assert torch.equal(again.model(ids).last_hidden_state, out.last_hidden_state)


def test_shift_labels_replace_labels(tmp_path):
    _, _, hf = loaded(tmp_path, "stem")
    ids = random_ids(2, 7, seed=20)
    shifted = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)  # what labels=ids gives after the shift
    assert torch.equal(hf(ids, shift_labels=shifted).loss, hf(ids, labels=ids).loss)
    other = random_ids(2, 7, seed=21)
    assert torch.equal(hf(ids, labels=other, shift_labels=shifted).loss, hf(ids, labels=ids).loss)
