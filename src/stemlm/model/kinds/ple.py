"""`ple`: a Gemma-3n-style per-layer embedding, a narrow token table gated by the hidden state, beside a dense FFN.

y = dense(x) + ple_proj( silu(ple_gate(x)) * P_l[t] )      P_l: [vocab_size, ple_dim]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stemlm.model.ffn import TokenContext, lookup, token_table
from stemlm.model.kinds.registry import Config, Field, Kind, LayerCount, Table


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


def count(config: Config, layer_idx: int) -> LayerCount:
    d, f, w = config.hidden_size, config.intermediate_size, config.ple_dim
    params = {"ffn_dense": 3 * d * f, "ple_proj": 2 * d * w, "ple_tables": config.vocab_size * w}
    return LayerCount(params, {"ffn_dense": 3 * d * f, "ple_proj": 2 * d * w}, w)  # ple_gate d->w, ple_proj w->d


KIND = Kind(
    name="ple",
    order=50,
    summary="per-layer embedding: dense(x) + ple_proj(silu(ple_gate x) * P_l[t])",
    build=PLEFFN,
    count=count,
    fields=(Field("ple_dim", "int", 256, "width of the PLE table and its side branch", positive=True),),
    tables=(Table("token", "ple_embedding"),),
    components=("ffn_dense", "ple_proj", "ple_tables"),
    table_components=("ple_tables",),
)
