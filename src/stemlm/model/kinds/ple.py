"""`ple`: a Gemma-3n-style per-layer embedding, a narrow token table gated by the hidden state, beside a dense FFN.

y = dense(x) + ple_proj( silu(ple_gate(x)) * P_l[t] )      P_l: [vocab_size, ple_dim]

`ple_variant="reference"` is transformers' Gemma-3n per-layer input path (`Gemma3nTextModel.project_per_layer_inputs`
and the end of `Gemma3nTextDecoderLayer.forward`), on one residual stream: with e_t the input embedding, r the
residual stream entering the FFN and o = r + dense(x) the layer's output without the branch,

    u_l = ( RMSNorm_p(W_m,l e_t / √d) + √p · P_l[t] ) / √2          W_m,l: Gemma's per_layer_model_projection rows of l
    y   = dense(x) + RMSNorm_d( ple_proj( gelu_tanh(ple_gate(o)) * u_l ) )

docs/kinds.md lists what still differs (altup streams, where the branch adds, the dense FFN's activation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stemlm.model.attention import RMSNorm
from stemlm.model.ffn import TokenContext, lookup, token_table
from stemlm.model.kinds.registry import Config, Field, Kind, LayerCount, Table

VARIANTS = ("stemlm", "reference")
# Gemma-3n's RMSNorm eps (`Gemma3nTextConfig.rms_norm_eps`'s default, what the shipped models use): the reference's
# two norms keep it whatever the backbone's `rms_norm_eps`, so the variant is Gemma-3n's function as shipped.
GEMMA3N_RMS_NORM_EPS = 1e-6


class PLEFFN(nn.Module):
    fusable = (("gate_proj", "up_proj", "ple_gate"),)  # the three projections of x: one product for decoding

    def __init__(self, config: Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        d, w = config.hidden_size, config.ple_dim
        self.gate_proj = nn.Linear(d, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, d, bias=False)
        self.ple_gate = nn.Linear(d, w, bias=False)
        self.ple_proj = nn.Linear(w, d, bias=False)
        self.ple_embedding = token_table(config.vocab_size, w)

    def forward(self, x: torch.Tensor, ctx: TokenContext) -> torch.Tensor:
        rows = lookup(self.ple_embedding, ctx, self.layer_idx)  # P_l[t]
        gate, up, ple_gate = self.gate_proj(x), self.up_proj(x), self.ple_gate(x)
        dense = self.down_proj(F.silu(gate) * up)
        return dense + self.ple_proj(F.silu(ple_gate) * rows.to(x.dtype))


class PLEReferenceFFN(PLEFFN):
    """Gemma-3n's per-layer input path (the module docstring): its gate reads the layer's output, so `ple_gate`
    shares no input with the dense projections (only those two are fused), and the module reads the residual."""

    fusable = (("gate_proj", "up_proj"),)
    reads_residual = True  # the decoder layer passes its residual stream r: forward(x, ctx, r)

    def __init__(self, config: Config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)  # PLEFFN's projections and table, in its parameter (= init) order
        d, w = config.hidden_size, config.ple_dim
        self.ple_model_proj = nn.Linear(d, w, bias=False)  # layer l's rows of Gemma's per_layer_model_projection
        self.ple_input_norm = RMSNorm(w, GEMMA3N_RMS_NORM_EPS)  # Gemma's per_layer_projection_norm
        self.ple_post_norm = RMSNorm(d, GEMMA3N_RMS_NORM_EPS)  # Gemma's post_per_layer_input_norm

    def per_layer_input(self, ctx: TokenContext) -> torch.Tensor:
        """u_l [B, T, ple_dim] of the positions in `ctx`, from their input embeddings and table rows."""
        e = ctx.embeddings
        width = self.ple_embedding.embedding_dim
        projected = self.ple_input_norm(self.ple_model_proj(e) * e.shape[-1] ** -0.5)
        rows = lookup(self.ple_embedding, ctx, self.layer_idx).to(e.dtype)
        return (projected + rows * width**0.5) * 2**-0.5

    def branch(self, out: torch.Tensor, per_layer_input: torch.Tensor) -> torch.Tensor:
        """RMSNorm_d(ple_proj(gelu_tanh(ple_gate(out)) * u_l)): out the layer's output [B, T, d], u_l [B, T, p]."""
        return self.ple_post_norm(self.ple_proj(F.gelu(self.ple_gate(out), approximate="tanh") * per_layer_input))

    def forward(self, x: torch.Tensor, ctx: TokenContext, residual: torch.Tensor) -> torch.Tensor:
        dense = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return dense + self.branch(residual + dense, self.per_layer_input(ctx).to(x.dtype))


def build(config: Config, layer_idx: int) -> nn.Module:
    return (PLEReferenceFFN if config.ple_variant == "reference" else PLEFFN)(config, layer_idx)


def count(config: Config, layer_idx: int) -> LayerCount:
    d, f, w = config.hidden_size, config.intermediate_size, config.ple_dim
    params = {"ffn_dense": 3 * d * f, "ple_proj": 2 * d * w, "ple_tables": config.vocab_size * w}
    if config.ple_variant == "reference":  # the per-layer input's projection d->w and the two norms
        params = {**params, "ple_proj": 3 * d * w, "norms": w + d}
        return LayerCount(params, {"ffn_dense": 3 * d * f, "ple_proj": 3 * d * w}, w)
    return LayerCount(params, {"ffn_dense": 3 * d * f, "ple_proj": 2 * d * w}, w)  # ple_gate d->w, ple_proj w->d


def check(config: Config, need) -> None:
    variant = config.ple_variant
    need(variant in VARIANTS, f"ple_variant must be one of {', '.join(VARIANTS)}, got {variant!r}")


KIND = Kind(
    name="ple",
    order=50,
    summary="per-layer embedding: dense(x) + ple_proj(silu(ple_gate x) * P_l[t])",
    build=build,
    count=count,
    fields=(
        Field("ple_dim", "int", 256, "width of the PLE table and its side branch", positive=True),
        Field(
            "ple_variant",
            "str",
            "stemlm",
            "stemlm: dense(x) + ple_proj(silu(ple_gate x) * P_l[t]); reference: Gemma-3n's per-layer input path",
        ),
    ),
    check=check,
    tables=(Table("token", "ple_embedding"),),
    components=("ffn_dense", "ple_proj", "ple_tables"),
    table_components=("ple_tables",),
    vllm_unserved=(
        "fits vLLM's step (a narrow token-indexed table gated by the hidden state, as vLLM's Gemma-3n "
        "has) but has no module there yet"
    ),
)
