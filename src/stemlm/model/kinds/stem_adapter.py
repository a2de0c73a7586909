"""`stem_adapter`: the retrofit adapter, a dense SwiGLU whose up-projection is blended with a token table.

    y = down_proj( silu(gate_proj(x)) * ((1 - g) ⊙ up_proj(x) + g ⊙ U[t]) ),   g = sigmoid(adapter_gate + GATE_BIAS)

This follows the official STEM code's adapter variant for retrofitting a pretrained dense model: the layer
starts as (almost) the dense layer it came from (the learned per-channel gate logits are initialised to 0,
so g = sigmoid(GATE_BIAS) ≈ 0.018) and training moves each channel toward the token table U (from
`stemlm convert --from-dense ... --retrofit adapter`, initialised like a plain retrofit). The table is a
normal STEM table (`stem_embedding`, a `token` table), so offload, editing and `--train tables` treat it as
one; the gate logits train with the tables (`trains_with_tables`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stemlm.model.ffn import TokenContext, lookup, token_table
from stemlm.model.kinds.registry import Config, Kind, LayerCount, Table

GATE_BIAS = -4.0  # sigmoid(-4) = 0.018: the blend starts 98% dense


class StemAdapterFFN(nn.Module):
    fusable = (("gate_proj", "up_proj"),)  # one product for decoding (stemlm.model.fusion)

    def __init__(self, config: Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.stem_embedding = token_table(config.vocab_size, f)
        self.adapter_gate = nn.Parameter(torch.zeros(f))

    def init_stds(self) -> dict[int, float]:
        return {id(self.adapter_gate): 0.0}  # std 0: logits start at exactly 0, g = sigmoid(GATE_BIAS)

    def blend(self) -> torch.Tensor:
        return torch.sigmoid(self.adapter_gate + GATE_BIAS)

    def forward(self, x: torch.Tensor, ctx: TokenContext) -> torch.Tensor:
        g = self.blend().to(x.dtype)
        table = lookup(self.stem_embedding, ctx, self.layer_idx).to(x.dtype)  # U_l[t]
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * ((1 - g) * up + g * table))


def count(config: Config, layer_idx: int) -> LayerCount:
    # the dense SwiGLU kept whole, plus the per-channel gate logits, and the table
    d, f = config.hidden_size, config.intermediate_size
    return LayerCount(
        {"ffn_dense": 3 * d * f + f, "token_tables": config.vocab_size * f}, {"ffn_dense": 3 * d * f + f}, f
    )


KIND = Kind(
    name="stem_adapter",
    order=90,
    summary="retrofit adapter: dense SwiGLU with up_proj x blended toward U_l[t] by a learned gate",
    build=StemAdapterFFN,
    count=count,
    tables=(Table("token", "stem_embedding"),),
    components=("ffn_dense", "token_tables"),
    table_components=("token_tables",),
    trains_with_tables=("adapter_gate",),
    vllm_unserved=(
        "fits vLLM's step (STEM's lookup blended with a dense up-projection by a learned per-channel "
        "gate) but has no module there yet"
    ),
)
