"""`Experts`: a stack of SwiGLU experts with dropless sort/gather dispatch, shared by `moe` and `hash_moe`.

Token-expert assignments are sorted by expert, each expert runs one matmul chain on its contiguous slice, and
results are scattered back with their routing weights. No capacity factor, so no token is ever dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Experts(nn.Module):
    """`num_experts` SwiGLU experts stored as stacked weights [E, out, in] (HF-style names per projection)."""

    fusable = (("gate_proj", "up_proj"),)  # each expert's gate and up, one product for decoding (stemlm.model.fusion)

    def __init__(self, num_experts: int, hidden_size: int, expert_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_proj = nn.Parameter(torch.empty(num_experts, expert_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, expert_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, expert_size))

    def forward(self, x: torch.Tensor, expert_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [N, d]; expert_idx, weights: [N, k]. Returns sum_k weights * expert_k(x): [N, d]."""
        N, k = expert_idx.shape
        flat_expert = expert_idx.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        token_of = order // k  # which token each sorted assignment belongs to
        counts = torch.bincount(flat_expert, minlength=self.num_experts).tolist()
        xs = x[token_of]
        flat_weights = weights.reshape(-1)
        # The k weighted expert outputs of a token are summed in fp32 whatever the model or autocast dtype, so a
        # bf16 model does not round between experts and index_add_ always sees one dtype.
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            xe = xs[start : start + n]
            gate, up = self.gate_up(e, xe)
            h = F.silu(gate) * up
            ye = (h @ self.down_proj[e].t()).float() * flat_weights[order[start : start + n], None].float()
            out.index_add_(0, token_of[start : start + n], ye)
            start += n
        return out.to(x.dtype)

    def gate_up(self, e: int, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Expert `e`'s gate and up projections of x [n, d]."""
        return x @ self.gate_proj[e].t(), x @ self.up_proj[e].t()
