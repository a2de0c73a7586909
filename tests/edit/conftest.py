"""Fixtures for the editing tests: a small BPE that keeps country names whole and a tiny model to edit.

`fact_tokenizer` is trained in milliseconds on a few fact sentences so " Spain" is one token and " United
Kingdom" two (a length mismatch); `edit_model(ffn)` is the shared tiny config with a vocabulary of 512 so
every id of that tokenizer is a row of the model. `reference_logits` is an independent plain-tensor forward
of the whole decoder with chosen rows substituted: the oracle the positional-edit tests compare against
(fixture `reference`).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from stemlm.data.tokenizer import train_bpe
from stemlm.model import build_model

NAMES = ["Spain", "Germany", "France", "Chile", "Peru", "United Kingdom", "South Korea", "Bosnia and Herzegovina"]


def build_fact_tokenizer():
    texts = [f"The capital of {n} is here. Country: {n}. Capital: {n}'s capital city" for n in NAMES] * 20
    return train_bpe(texts, vocab_size=400)


@pytest.fixture(scope="session")
def _fact_tokenizer_json():
    return build_fact_tokenizer().to_str()


@pytest.fixture
def fact_tokenizer(_fact_tokenizer_json):
    # A fresh object per test: injection adds tokens to the tokenizer it is given.
    return Tokenizer.from_str(_fact_tokenizer_json)


@pytest.fixture
def edit_model(tiny_config):
    def make(ffn: str = "stem", seed: int = 0, **overrides):
        return build_model(tiny_config(ffn, **{"vocab_size": 512, **overrides}), seed=seed).eval()

    return make


@pytest.fixture
def reference():
    return reference_logits


def _rms(x, w, eps):
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos[:, None].double() * inv[None]  # [T, hd/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1).float(), torch.cat([ang.sin(), ang.sin()], -1).float()
    rotated = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
    return x * cos + rotated * sin


def reference_logits(model, ids: torch.Tensor, stem_rows: dict | None = None, embed_rows=None) -> torch.Tensor:
    """Logits [T, V] of one sequence `ids` [T], from the state dict with plain tensor ops.

    `stem_rows[layer]` ([T, d_ff]) replaces the table lookup of that layer and `embed_rows` ([T, d]) the token
    embedding; everything else is the textbook Llama block with a STEM or dense SwiGLU FFN."""
    cfg, sd = model.config, {k: v.detach().float() for k, v in model.state_dict().items()}
    T, H, KV, hd = ids.shape[0], cfg.num_attention_heads, cfg.kv_heads, cfg.head_size
    x = sd["model.embed_tokens.weight"][ids] if embed_rows is None else embed_rows.float()
    pos = torch.arange(T)
    causal = torch.ones(T, T).tril().bool()
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        h = _rms(x, sd[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(T, H, hd).transpose(0, 1)
        k = (h @ sd[p + "self_attn.k_proj.weight"].T).view(T, KV, hd).transpose(0, 1)
        v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(T, KV, hd).transpose(0, 1)
        q, k = _rope(q, pos, cfg.rope_theta), _rope(k, pos, cfg.rope_theta)
        heads = []
        for head in range(H):
            kv = head // (H // KV)
            scores = (q[head] @ k[kv].T) / math.sqrt(hd)
            heads.append(scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v[kv])
        x = x + torch.cat(heads, -1) @ sd[p + "self_attn.o_proj.weight"].T
        h = _rms(x, sd[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        gate = F.silu(h @ sd[p + "mlp.gate_proj.weight"].T)
        if p + "mlp.stem_embedding.weight" in sd:
            up = sd[p + "mlp.stem_embedding.weight"][ids]
            if stem_rows is not None and i in stem_rows:
                up = stem_rows[i].float()
        else:
            up = h @ sd[p + "mlp.up_proj.weight"].T
        x = x + (gate * up) @ sd[p + "mlp.down_proj.weight"].T
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    return _rms(x, sd["model.norm.weight"], cfg.rms_norm_eps) @ head.T
