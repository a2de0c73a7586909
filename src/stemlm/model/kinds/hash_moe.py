"""`hash_moe`: Hash Layers (Roller et al. 2021), every vocabulary id routed to one fixed expert.

The id -> expert map is a seeded, balanced assignment (`balanced_hash`, seed `hash_seed + layer_idx`), rebuilt
from the config, so it is not stored; no router, no balancing loss. Experts are `stemlm.model.experts.Experts`.
"""

from __future__ import annotations

import torch
from torch import nn

from stemlm.model.experts import Experts
from stemlm.model.ffn import TokenContext
from stemlm.model.kinds.moe import MOE_INTERMEDIATE_SIZE, NUM_EXPERTS
from stemlm.model.kinds.registry import Config, Kind, LayerCount


def balanced_hash(vocab_size: int, num_experts: int, seed: int) -> torch.Tensor:
    """A fixed id -> expert map: a seeded permutation of ids dealt round-robin, so expert sizes differ by <= 1."""
    generator = torch.Generator().manual_seed(seed)
    # Built on the CPU explicitly so that constructing a model on the meta device still gets the real map.
    perm = torch.randperm(vocab_size, generator=generator, device="cpu")
    assignment = torch.empty(vocab_size, dtype=torch.long, device="cpu")
    assignment[perm] = torch.arange(vocab_size, device="cpu") % num_experts
    return assignment


class HashMoEFFN(nn.Module):
    def __init__(self, config: Config, layer_idx: int) -> None:
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


def count(config: Config, layer_idx: int) -> LayerCount:
    # HashMoEFFN gives each expert the full dense width unless moe_intermediate_size is set (one expert a token).
    expert = 3 * config.hidden_size * (config.moe_intermediate_size or config.intermediate_size)
    return LayerCount(
        {"moe_experts": config.num_experts * expert},
        {"moe_experts": expert},
        inactive=(config.num_experts - 1) * expert,
    )


KIND = Kind(
    name="hash_moe",
    order=40,
    summary="hash layers: each token id routed to one fixed expert by a seeded balanced map",
    build=HashMoEFFN,
    count=count,
    fields=(NUM_EXPERTS, MOE_INTERMEDIATE_SIZE),
    components=("moe_experts",),
    routes_by_id=True,
    vllm_unserved=(
        "fits vLLM's step (FusedMoE with experts read from a fixed id -> expert map) but has no module there yet"
    ),
)
