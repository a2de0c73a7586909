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

`engram_variant="reference"` is the function of DeepSeek's public demo (`engram_demo_v1.py`) instead: biases on
W_K and W_V, the query and key norms at machine epsilon (torch's `nn.RMSNorm(eps=None)`), the conv norm at 1e-5,
the demo's hashing (`stemlm.model.ngram.PerLayerNgramHasher`: multipliers per layer, ids mixed as they are,
the pad id `engram_pad_id` before the start, a prime per (layer, order, head)), and the branch added to the
residual stream before the layer's attention, its query the residual stream itself:

    x <- x + v_t + silu( conv( norm_c(v) )_t ),   v_t = g_t · (W_V e_t + b_V),
    g_t  = sigmoid( ssqrt( <norm_q(x_t), norm_k(W_K e_t + b_K)> / sqrt(d) ) )

The FFN kind then keeps only its dense FFN at the FFN position. docs/kinds.md lists what still differs.

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
from stemlm.model.ffn import DenseFFN, TokenContext, token_table
from stemlm.model.kinds.registry import Beside, Config, Field, Kind, LayerCount, Table, get_kind, table_key
from stemlm.model.ngram import ngram_hasher, ngram_lookup
from stemlm.model.ngram_layout import check_orders, ngram_layout

NAME = "engram"
VARIANTS = ("stemlm", "reference")
REFERENCE_CONV_EPS = 1e-5  # the demo's ShortConv norms take its norm_eps default, not machine epsilon


def is_reference(config: Config) -> bool:
    return config.engram_variant == "reference"


class _Branch:
    """The Engram branch, shared by the FFN kind and the side module (one implementation): `_init_branch` adds its
    parameters after the module's own (the parameter order is the init order), `add_branch` adds its output."""

    def _init_branch(self, config: Config, layer_idx: int, side: str | None) -> None:
        d, e = config.hidden_size, config.engram_dim
        hasher = ngram_hasher(config)
        reference = is_reference(config)
        self.layer_idx, self.table_key = layer_idx, table_key(config, layer_idx, side)
        self.engram_embedding = token_table(hasher.num_rows_of(layer_idx), e // hasher.num_keys)
        self.engram_key_proj = nn.Linear(e, d, bias=reference)
        self.engram_value_proj = nn.Linear(e, d, bias=reference)
        gate_eps = None if reference else config.rms_norm_eps  # None: machine epsilon (stemlm.model.attention)
        self.engram_query_norm = RMSNorm(d, gate_eps)
        self.engram_key_norm = RMSNorm(d, gate_eps)
        self.engram_conv_norm = RMSNorm(d, REFERENCE_CONV_EPS if reference else config.rms_norm_eps)
        self.dilation = hasher.context + 1
        self.engram_conv = nn.Conv1d(d, d, config.engram_kernel, groups=d, dilation=self.dilation, bias=False)
        self.context = (config.engram_kernel - 1) * self.dilation  # earlier positions one output reads

    def init_stds(self) -> dict[int, float]:
        # N(0, 1) rows as nn.Embedding (and the demo) draw them: the key is normalised and W_V is small.
        return {id(self.engram_embedding.weight): 1.0}

    def add_branch(self, x: torch.Tensor, ctx: TokenContext, out: torch.Tensor) -> torch.Tensor:
        """`out` (the FFN output of the same input `x`) + v_t + silu(conv(norm_c(v))_t)."""
        value = self._gated_value(x, ctx)
        return out + value + F.silu(self._conv(self.engram_conv_norm(value), ctx))

    def residual_branch(self, x: torch.Tensor, ctx: TokenContext) -> torch.Tensor:
        """v_t + silu(conv(norm_c(v))_t) of the residual stream `x` (the reference variant, before attention)."""
        value = self._gated_value(x, ctx)
        return value + F.silu(self._conv(self.engram_conv_norm(value), ctx))

    def _gated_value(self, x: torch.Tensor, ctx: TokenContext) -> torch.Tensor:
        """v_t = g_t · W_V e_t, the gate g_t scoring the query `x` against the key of the rows e_t."""
        memory = ngram_lookup(self.engram_embedding, ctx, self.table_key, self.layer_idx).flatten(-2).to(x.dtype)
        key = self.engram_key_norm(self.engram_key_proj(memory))
        score = (self.engram_query_norm(x) * key).sum(-1, keepdim=True) / math.sqrt(x.shape[-1])
        gate = torch.sigmoid(score.sign() * score.abs().clamp_min(1e-6).sqrt())
        return gate * self.engram_value_proj(memory)

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


class EngramFFN(_Branch, DenseFFN):
    """The FFN kind: a dense SwiGLU plus the branch (the reference variant: the dense SwiGLU alone; the decoder adds
    `residual_branch` before attention, `Kind.acts_on_residual`)."""

    def __init__(self, config: Config, layer_idx: int) -> None:
        DenseFFN.__init__(self, config.hidden_size, config.intermediate_size)
        self._init_branch(config, layer_idx, side=None)
        self.branch_at_ffn = not is_reference(config)

    def forward(self, x: torch.Tensor, ctx: TokenContext) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        dense = self.down_proj(F.silu(gate) * up)
        return self.add_branch(x, ctx, dense) if self.branch_at_ffn else dense


class EngramBranch(_Branch, nn.Module):
    """Beside another FFN kind: the branch alone, at `model.layers.<i>.beside.engram`, added to the FFN output
    (the reference variant: the decoder adds its `residual_branch` to the residual stream before attention)."""

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
        "ngram_tables": layout.rows_of(layer_idx) * (e // layout.num_keys),
    }
    if is_reference(config):
        params["engram_bias"] = 2 * d  # b_K and b_V: added per token, not multiplied (no FLOPs counted)
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
    need(
        config.engram_variant in VARIANTS,
        f"engram_variant must be one of {', '.join(VARIANTS)}, got {config.engram_variant!r}",
    )
    if is_reference(config):
        ok = isinstance(config.engram_pad_id, int) and 0 <= config.engram_pad_id < config.vocab_size
        need(ok, f"engram_pad_id={config.engram_pad_id!r} must be a token id in [0, vocab_size={config.vocab_size})")
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
        Field(
            "engram_variant",
            "str",
            "stemlm",
            "stemlm: the branch at the FFN position, shared hashing; reference: DeepSeek's demo (docs/kinds.md)",
        ),
        Field("engram_pad_id", "int", 2, "reference variant: the id hashed before the sequence start (demo: 2)"),
    ),
    check=check,
    tables=(Table("ngram", "engram_embedding"),),
    components=("ffn_dense", "engram_proj", "engram_bias", "ngram_tables"),
    table_components=("ngram_tables",),
    scalar_components=("engram_bias",),
    ngram=lambda config: (config.engram_orders, config.engram_heads, config.engram_rows),
    ngram_per_layer=lambda config: config.engram_pad_id if is_reference(config) else None,
    acts_on_residual=is_reference,
    beside=Beside(
        build=EngramBranch,
        count=count_branch,
        acts_on=lambda config: "residual" if is_reference(config) else "ffn",
    ),
    vllm_unserved=None,
)
