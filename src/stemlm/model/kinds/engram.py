"""`engram`: a dense SwiGLU FFN plus the Engram conditional-memory branch (arXiv 2601.07372), or the branch alone.

    e_t   = concat_k E[id_k(t)]                      hashed 2/3-gram rows, K = orders x heads (stemlm.model.ngram)
    g_t   = sigmoid( ssqrt( <norm_q(x_t), norm_k(W_K e_t)> / sqrt(d) ) )     a scalar context gate, ssqrt = sign·sqrt|.|
    v_t   = g_t · W_V e_t
    y_t   = dense(x_t) + v_t + silu( conv( norm_c(v) )_t )                   causal depthwise conv, kernel 4,
                                                                             dilation = the largest order
Beside another FFN kind (`engram_layers`), the branch alone (`EngramBranch`, at `model.layers.<i>.beside.engram`)
adds its v_t + silu(conv(...)) to that kind's output; the FFN kind and the side module share one implementation.
The branch follows the paper and DeepSeek's public demo (read for facts, written anew). One deliberate
difference: the paper adds the branch to the residual stream before a block's attention; here it runs at the
FFN position of its layer, beside the kept dense FFN and from the same normalised input, so that it enters
through the per-layer seam like every other kind. The hashing is shared by all Engram layers of a model
(offload reads one row per n-gram id for every layer) and the paper's tokenizer compression (merging ids
that normalise to the same text) is not applied: ids are hashed as they are.

Decoding: the conv needs the conv inputs of the (kernel - 1) · dilation positions before the new ones. They
are kept, for every position, in the cache's decoding state (`TokenContext.state`, like the keys and values
of a KV cache), so a cropped cache stays consistent; left-padding positions feed zeros, as a sequence start
does. FLOPs: W_K and W_V are matmuls, the conv costs 2 · d · kernel per token (FlopCounterMode counts it);
the gate's dot product and the row concatenation are not matmuls and are not counted.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from stemlm.model.attention import RMSNorm
from stemlm.model.ffn import TokenContext, token_table
from stemlm.model.kinds.registry import Beside, Config, Field, Kind, LayerCount, Table, get_kind, table_key
from stemlm.model.ngram import ngram_hasher, ngram_lookup
from stemlm.model.ngram_layout import check_orders, ngram_layout

NAME = "engram"


class _Branch:
    """The Engram branch, shared by the FFN kind and the side module (one implementation): `_init_branch` adds its
    parameters after the module's own (the parameter order is the init order), `add_branch` adds its output."""

    def _init_branch(self, config: Config, layer_idx: int, side: str | None) -> None:
        d, e = config.hidden_size, config.engram_dim
        hasher = ngram_hasher(config)
        self.layer_idx, self.table_key = layer_idx, table_key(config, layer_idx, side)
        self.engram_embedding = token_table(hasher.num_rows, e // hasher.num_keys)
        self.engram_key_proj = nn.Linear(e, d, bias=False)
        self.engram_value_proj = nn.Linear(e, d, bias=False)
        self.engram_query_norm = RMSNorm(d, config.rms_norm_eps)
        self.engram_key_norm = RMSNorm(d, config.rms_norm_eps)
        self.engram_conv_norm = RMSNorm(d, config.rms_norm_eps)
        self.dilation = hasher.context + 1
        self.engram_conv = nn.Conv1d(d, d, config.engram_kernel, groups=d, dilation=self.dilation, bias=False)
        self.context = (config.engram_kernel - 1) * self.dilation  # earlier positions one output reads

    def init_stds(self) -> dict[int, float]:
        # N(0, 1) rows as nn.Embedding (and the demo) draw them: the key is normalised and W_V is small.
        return {id(self.engram_embedding.weight): 1.0}

    def add_branch(self, x: torch.Tensor, ctx: TokenContext, out: torch.Tensor) -> torch.Tensor:
        """`out` (the FFN output of the same input `x`) + v_t + silu(conv(norm_c(v))_t)."""
        memory = ngram_lookup(self.engram_embedding, ctx, self.table_key).flatten(-2).to(x.dtype)  # e_t
        key = self.engram_key_norm(self.engram_key_proj(memory))
        score = (self.engram_query_norm(x) * key).sum(-1, keepdim=True) / math.sqrt(x.shape[-1])
        gate = torch.sigmoid(score.sign() * score.abs().clamp_min(1e-6).sqrt())
        value = gate * self.engram_value_proj(memory)
        return out + value + F.silu(self._conv(self.engram_conv_norm(value), ctx))

    def _conv(self, inputs: torch.Tensor, ctx: TokenContext) -> torch.Tensor:
        """Causal dilated depthwise conv over [B, T, d], continuing the positions kept in the decoding state."""
        if ctx.valid is not None:
            inputs = inputs * ctx.valid[..., None].to(inputs.dtype)
        B, T, d = inputs.shape
        key = f"engram_conv.{self.layer_idx}"  # one Engram branch per layer (config check)
        past = None
        if ctx.state is not None:
            past = ctx.state.get(key)
            past = None if past is None or ctx.past_len == 0 else past[:, : ctx.past_len]
            ctx.state[key] = inputs if past is None else torch.cat([past, inputs.to(past.dtype)], dim=1)
        left = inputs.new_zeros(B, self.context, d)
        if past is not None:
            keep = min(self.context, past.shape[1])
            left[:, self.context - keep :] = past[:, past.shape[1] - keep :].to(inputs.dtype)
        full = torch.cat([left, inputs], dim=1).transpose(1, 2)  # [B, d, context + T]
        return self.engram_conv(full).transpose(1, 2)


class EngramFFN(_Branch, nn.Module):
    """The FFN kind: a dense SwiGLU plus the branch."""

    fusable = (("gate_proj", "up_proj"),)  # one product for decoding (stemlm.model.fusion)

    def __init__(self, config: Config, layer_idx: int) -> None:
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self._init_branch(config, layer_idx, side=None)

    def forward(self, x: torch.Tensor, ctx: TokenContext) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.add_branch(x, ctx, self.down_proj(F.silu(gate) * up))


class EngramBranch(_Branch, nn.Module):
    """Beside another FFN kind: the branch alone, at `model.layers.<i>.beside.engram`, added to the FFN output."""

    def __init__(self, config: Config, layer_idx: int) -> None:
        super().__init__()
        self._init_branch(config, layer_idx, side=NAME)

    def forward(self, x: torch.Tensor, ctx: TokenContext, out: torch.Tensor) -> torch.Tensor:
        return self.add_branch(x, ctx, out)


def count_branch(config: Config, layer_idx: int) -> LayerCount:
    """The branch alone (beside another FFN kind)."""
    d, e = config.hidden_size, config.engram_dim
    layout = ngram_layout(config)
    # W_K and W_V (e -> d) and the depthwise conv (d x kernel weights, each one MAC per token)
    proj = 2 * e * d + d * config.engram_kernel
    params = {
        "engram_proj": proj,
        "norms": 3 * d,  # query, key and conv-input norms
        "ngram_tables": layout.num_rows * (e // layout.num_keys),
    }
    return LayerCount(params, {"engram_proj": proj}, e)


def count(config: Config, layer_idx: int) -> LayerCount:
    dense = 3 * config.hidden_size * config.intermediate_size
    branch = count_branch(config, layer_idx)
    return LayerCount({"ffn_dense": dense, **branch.params}, {"ffn_dense": dense, **branch.matmul}, branch.rows)


def check(config: Config, need) -> None:
    check_orders("engram_orders", config.engram_orders, need)
    if config.beside_layers(NAME) and config.special_layers:
        other = get_kind(config.ffn).ngram is not None
        need(not other, f"engram_layers: the FFN kind {config.ffn} has n-gram keys already (one n-gram kind per model)")
    keys = len(str(config.engram_orders).split(",")) * config.engram_heads
    need(
        config.engram_dim % keys == 0,
        f"engram_dim={config.engram_dim} must divide evenly over orders x heads = {keys} hash heads",
    )


KIND = Kind(
    name=NAME,
    order=70,
    summary="dense FFN plus the Engram branch: gated hashed 2/3-gram memory and a short causal conv",
    build=EngramFFN,
    count=count,
    fields=(
        Field("engram_orders", "str", "2,3", "n-gram orders of the Engram memory"),
        Field("engram_heads", "int", 4, "hash heads per order", positive=True),
        Field(
            "engram_rows", "int | None", None, "rows per head (rounded up to a prime); None: vocab_size", positive=True
        ),
        Field(
            "engram_dim", "int", 256, "width of the concatenated memory e_t (split over orders x heads)", positive=True
        ),
        Field(
            "engram_kernel", "int", 4, "kernel of the causal conv (its dilation is the largest order)", positive=True
        ),
    ),
    check=check,
    tables=(Table("ngram", "engram_embedding"),),
    components=("ffn_dense", "engram_proj", "ngram_tables"),
    table_components=("ngram_tables",),
    ngram=lambda config: (config.engram_orders, config.engram_heads, config.engram_rows),
    beside=Beside(build=EngramBranch, count=count_branch, acts_on="ffn"),
)
