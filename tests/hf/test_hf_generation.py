"""Generation conventions of `StemlmForCausalLM` (issue 24 point 4): `generate()` stops on the tokenizer's EOS by
default, as `stemlm generate` does; the GenerationConfig is saved with the model; and left-padded batched generation
equals per-prompt generation for every kind, the n-gram and Engram ones (whose decoding state keeps earlier ids and
conv inputs) included."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GenerationConfig

from stemlm.checkpoint.folder import save_pretrained
from stemlm.data.tokenizer import default_tokenizer, eot_id
from stemlm.hf import StemlmConfig, StemlmForCausalLM
from stemlm.inference.generate import generate
from stemlm.model import build_model
from stemlm.model.config import FFN_KINDS
from tests.hf.test_hf import VOCAB, random_ids, randomize_, tiny_config
from tests.hf.test_remote_code import make_eos_reachable, tiny

PAD = 0


def hf_model(kind: str) -> StemlmForCausalLM:
    """A random HF model of `kind` (no cache-less shortcut: generation runs through HF's DynamicCache)."""
    config = tiny_config(kind, value_embed_tables=1, engram_dim=16, memory_keys=8, memory_topk=4)
    model = StemlmForCausalLM(StemlmConfig.from_model_config(config, pad_token_id=PAD))
    randomize_(model, seed=4)
    return model.eval()


@pytest.mark.parametrize("kind", FFN_KINDS)
def test_left_padded_batch_equals_each_prompt_alone(kind):
    model = hf_model(kind)
    prompts = [random_ids(1, n, seed=20 + n)[0] for n in (7, 3, 5)]
    width = max(len(p) for p in prompts)
    batch = torch.stack([F.pad(p, (width - len(p), 0), value=PAD) for p in prompts])
    mask = torch.stack([F.pad(torch.ones(len(p), dtype=torch.long), (width - len(p), 0)) for p in prompts])
    out = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
    for row, prompt in zip(out[:, width:], prompts, strict=True):
        alone = model.generate(prompt[None], max_new_tokens=6, do_sample=False, eos_token_id=None)[0, len(prompt) :]
        assert row.tolist() == alone.tolist()
    assert len(set(out[:, width:].flatten().tolist())) > 2  # varied continuations, so the comparison bites


def test_generate_stops_on_the_tokenizer_eos_by_default(tmp_path):
    model = build_model(tiny("stem"), seed=3).eval()
    prompt = [5, 17, 300, 42]
    make_eos_reachable(model, prompt)
    save_pretrained(model, tmp_path / "ckpt", default_tokenizer())
    assert "eos_token_id" not in json.loads((tmp_path / "ckpt" / "config.json").read_text())
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    eos = eot_id(default_tokenizer())
    assert hf.config.eos_token_id == hf.generation_config.eos_token_id == eos
    ours = generate(model, prompt, 12, greedy=True, eos_id=eos)  # what `stemlm generate` stops on
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :].tolist()
    assert theirs == ours and ours[-1] == eos and len(ours) < 12


def test_generation_config_is_saved_with_the_model(tmp_path):
    model = build_model(tiny("stem"), seed=0)
    save_pretrained(model, tmp_path / "ckpt", default_tokenizer())
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    hf.save_pretrained(tmp_path / "hf")
    saved = GenerationConfig.from_pretrained(tmp_path / "hf")
    assert saved.eos_token_id == eot_id(default_tokenizer())
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").generation_config.eos_token_id == saved.eos_token_id


def test_a_folder_without_tokenizer_keeps_no_eos(tmp_path):
    save_pretrained(build_model(tiny_config("stem"), seed=0), tmp_path / "ckpt")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert hf.config.eos_token_id is None and hf.config.vocab_size == VOCAB
