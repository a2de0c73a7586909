"""Routed baselines: a top-k MoE of SwiGLU experts and Hash Layers (Roller et al. 2021).

Both share `Experts`, a stack of SwiGLU experts with dropless sort/gather dispatch: token-expert
assignments are sorted by expert, each expert runs one matmul chain on its contiguous slice, and results
are scattered back with their routing weights. No capacity factor, so no token is ever dropped.

- `MoEFFN`: softmax router, top-k, weights renormalised over the chosen k (Mixtral style), Switch
  load-balancing loss `E * sum_e f_e * P_e` (1.0 exactly when routing is uniform, its minimum) and an
  optional router z-loss, both appended to the context's `aux_losses`.
- `HashMoEFFN`: every vocabulary id goes to one fixed expert given by a seeded, balanced assignment; no
  router, no balancing loss. The assignment is rebuilt from the config (seed), so it is not stored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stemlm.model.config import ModelConfig
from stemlm.model.ffn import DenseFFN, TokenContext


class Experts(nn.Module):
    """`num_experts` SwiGLU experts stored as stacked weights [E, out, in] (HF-style names per projection)."""

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
            h = F.silu(xe @ self.gate_proj[e].t()) * (xe @ self.up_proj[e].t())
            ye = (h @ self.down_proj[e].t()).float() * flat_weights[order[start : start + n], None].float()
            out.index_add_(0, token_of[start : start + n], ye)
            start += n
        return out.to(x.dtype)


class MoEFFN(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.top_k = config.num_experts_per_tok
        self.use_z_loss = config.router_z_loss
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, config.hidden_size, config.expert_size)
        self.shared_expert = DenseFFN(config.hidden_size, config.expert_size) if config.moe_shared_expert else None

    def forward(self, x: torch.Tensor, ctx: TokenContext) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.router(flat).float()
        probs = logits.softmax(dim=-1)
        top_logits, top_idx = logits.topk(self.top_k, dim=-1)
        weights = top_logits.softmax(dim=-1)
        out = self.experts(flat, top_idx, weights)
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        counts = torch.bincount(top_idx.reshape(-1), minlength=probs.shape[-1])
        ctx.expert_counts[self.layer_idx] = counts.detach()
        ctx.aux_losses.append(load_balancing_loss(probs, counts))
        if self.use_z_loss:
            ctx.aux_losses.append(torch.logsumexp(logits, dim=-1).pow(2).mean())
        return out.reshape(shape)


def load_balancing_loss(probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Switch Transformer auxiliary loss: E · Σ_e (fraction of assignments to e) · (mean router prob of e)."""
    num_experts = probs.shape[-1]
    fraction = counts.float() / counts.sum().clamp(min=1)
    return num_experts * (fraction * probs.mean(dim=0)).sum()


def balanced_hash(vocab_size: int, num_experts: int, seed: int) -> torch.Tensor:
    """A fixed id -> expert map: a seeded permutation of ids dealt round-robin, so expert sizes differ by <= 1."""
    generator = torch.Generator().manual_seed(seed)
    # Built on the CPU explicitly so that constructing a model on the meta device still gets the real map.
    perm = torch.randperm(vocab_size, generator=generator, device="cpu")
    assignment = torch.empty(vocab_size, dtype=torch.long, device="cpu")
    assignment[perm] = torch.arange(vocab_size, device="cpu") % num_experts
    return assignment


class HashMoEFFN(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        # One expert per token, so each expert gets the full dense width unless set: matched active FFN size.
        size = config.moe_intermediate_size or config.intermediate_size
        self.experts = Experts(config.num_experts, config.hidden_size, size)
        # Seed differs per layer so layers do not share one partition of the vocabulary.
        self.hash_args = (config.vocab_size, config.num_experts, config.hash_seed + layer_idx)
        self.register_buffer("expert_of_token", balanced_hash(*self.hash_args), persistent=False)

    def reset_buffers(self, device: torch.device | str) -> None:
        self.expert_of_token = balanced_hash(*self.hash_args).to(device)

    def forward(self, x: torch.Tensor, ctx: TokenContext) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        expert_idx = self.expert_of_token[ctx.input_ids.reshape(-1)][:, None]
        out = self.experts(flat, expert_idx, torch.ones_like(expert_idx, dtype=flat.dtype))
        ctx.expert_counts[self.layer_idx] = torch.bincount(expert_idx.reshape(-1), minlength=self.experts.num_experts)
        return out.reshape(shape)
