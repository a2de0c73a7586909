"""`stem_gate`: the paper's worse ablation, the gate replaced by a context-free token table, the up-projection kept.

y = down_proj( silu(G_l[t]) * up_proj(x) )
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stemlm.model.ffn import TokenContext, lookup, token_table
from stemlm.model.kinds import stem
from stemlm.model.kinds.registry import Config, Kind, Table


class StemGateFFN(nn.Module):
    def __init__(self, config: Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.stem_embedding = token_table(config.vocab_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, ctx: TokenContext) -> torch.Tensor:
        gate = lookup(self.stem_embedding, ctx, self.layer_idx)  # G_l[t]
        return self.down_proj(F.silu(gate.to(x.dtype)) * self.up_proj(x))


KIND = Kind(
    name="stem_gate",
    order=20,
    summary="ablation: down_proj(silu(G_l[t]) * up_proj x), the gate replaced by a token table",
    build=StemGateFFN,
    count=stem.count,
    tables=(Table("token", "stem_embedding"),),
    components=stem.KIND.components,
    table_components=stem.KIND.table_components,
    replaces_projection=True,
    vllm_unserved=(
        "fits vLLM's step (a token-indexed lookup like STEM's: the gate's rows) but has no module there yet"
    ),
)
