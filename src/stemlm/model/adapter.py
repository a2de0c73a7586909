"""The retrofit adapter FFN (`ffn="stem_adapter"`): a dense SwiGLU whose up-projection is blended with a table.

    y = down_proj( silu(gate_proj(x)) * ((1 - g) ⊙ up_proj(x) + g ⊙ U[t]) ),   g = sigmoid(adapter_gate + GATE_BIAS)

This follows the official STEM code's adapter variant for retrofitting a pretrained dense model: the layer
starts as (almost) the dense layer it came from (the learned per-channel gate logits are initialised to 0,
so g = sigmoid(GATE_BIAS) ≈ 0.018) and training moves each channel toward the token table U (from
`stemlm convert --from-dense ... --retrofit adapter`, initialised like a plain retrofit). The table is a
normal STEM table (`stem_embedding`), so offload, editing and `--train tables` treat it as one; the gate
logits train with the tables.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stemlm.model.config import ModelConfig
from stemlm.model.ffn import TokenContext, lookup, token_table

GATE_BIAS = -4.0  # sigmoid(-4) = 0.018: the blend starts 98% dense


class StemAdapterFFN(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
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
        return self.down_proj(F.silu(self.gate_proj(x)) * ((1 - g) * self.up_proj(x) + g * table))
