"""`stem`: the up-projection replaced by a per-layer table indexed by the input token id.

    y = down_proj( silu(gate_proj(x)) * U_l[t] )        U_l: [vocab_size, intermediate_size], t the input id

The table `stem_embedding` is a `token` table (stemlm.model.kinds.registry.FAMILIES): offloaded with prefetch,
row-sharded under `--nproc`, edited by positional and global edits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stemlm.model.ffn import TokenContext, lookup, token_table
from stemlm.model.kinds.dense import swiglu_activations
from stemlm.model.kinds.registry import Config, Kind, LayerCount, Table


class StemFFN(nn.Module):
    fusable = (("gate_proj",),)  # alone: a decoding copy where it is stored transposed (stemlm.model.fusion)

    def __init__(self, config: Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.stem_embedding = token_table(config.vocab_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, ctx: TokenContext) -> torch.Tensor:
        up = lookup(self.stem_embedding, ctx, self.layer_idx)  # U_l[t], t = the input id at each position
        return self.down_proj(F.silu(self.gate_proj(x)) * up.to(x.dtype))


def count(config: Config, layer_idx: int) -> LayerCount:
    """Two projections (the table replaces the third) and one d_ff row per token; also `stem_gate`'s count."""
    d, f = config.hidden_size, config.intermediate_size
    return LayerCount({"stem_proj": 2 * d * f, "token_tables": config.vocab_size * f}, {"stem_proj": 2 * d * f}, f)


KIND = Kind(
    name="stem",
    order=10,
    summary="STEM: down_proj(silu(gate_proj x) * U_l[t]), the up-projection replaced by a token table",
    build=StemFFN,
    count=count,
    tables=(Table("token", "stem_embedding"),),
    components=("stem_proj", "token_tables"),
    table_components=("token_tables",),
    replaces_projection=True,
    activation_elements=swiglu_activations,
    vllm_unserved=None,
)
