"""`moe`: a top-k mixture of SwiGLU experts (`stemlm.model.experts`), Mixtral-style routing.

Softmax router, top-k, weights renormalised over the chosen k, Switch load-balancing loss
`E * sum_e f_e * P_e` (1.0 exactly when routing is uniform, its minimum) and an optional router z-loss, both
appended to the context's `aux_losses`; tokens routed per expert go to `ctx.expert_counts`.
"""

from __future__ import annotations

import torch
from torch import nn

from stemlm.model.experts import Experts
from stemlm.model.ffn import DenseFFN, TokenContext
from stemlm.model.kinds.registry import Config, Field, Kind, LayerCount

NUM_EXPERTS = Field("num_experts", "int", 8, "experts per MoE / hash-MoE layer", positive=True)
MOE_INTERMEDIATE_SIZE = Field(
    "moe_intermediate_size",
    "int | None",
    None,
    "width of one expert; None: intermediate_size // num_experts_per_tok (moe, a matched active FFN) or "
    "intermediate_size (hash_moe, one expert a token)",
    positive=True,
)


def expert_size(config: Config) -> int:
    return config.moe_intermediate_size or max(1, config.intermediate_size // config.num_experts_per_tok)


class MoEFFN(nn.Module):
    def __init__(self, config: Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.top_k = config.num_experts_per_tok
        self.use_z_loss = config.router_z_loss
        size = expert_size(config)
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, config.hidden_size, size)
        self.shared_expert = DenseFFN(config.hidden_size, size) if config.moe_shared_expert else None

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


def count(config: Config, layer_idx: int) -> LayerCount:
    d, E, k = config.hidden_size, config.num_experts, config.num_experts_per_tok
    expert = 3 * d * expert_size(config)
    params = {"moe_router": d * E, "moe_experts": E * expert}
    used = {"moe_router": d * E, "moe_experts": k * expert}
    if config.moe_shared_expert:
        params["moe_shared"] = used["moe_shared"] = expert
    return LayerCount(params, used, inactive=(E - k) * expert)  # the experts a token is not routed to


def check(config: Config, need) -> None:
    need(
        config.num_experts_per_tok <= config.num_experts,
        f"num_experts_per_tok={config.num_experts_per_tok} exceeds num_experts={config.num_experts}",
    )


KIND = Kind(
    name="moe",
    order=30,
    summary="top-k mixture of SwiGLU experts with a softmax router and a load-balancing loss",
    build=MoEFFN,
    count=count,
    fields=(
        NUM_EXPERTS,
        Field("num_experts_per_tok", "int", 2, "experts a token is routed to (top-k)", positive=True),
        MOE_INTERMEDIATE_SIZE,
        Field("moe_shared_expert", "bool", False, "add an always-on shared expert of the expert width"),
        Field("router_z_loss", "bool", False, "add the router z-loss to the auxiliary loss"),
    ),
    check=check,
    components=("moe_router", "moe_experts", "moe_shared"),
    resolved=lambda config: {"moe_intermediate_size": expert_size(config)},
    vllm_unserved="fits vLLM's step (its FusedMoE with a softmax top-k router) but has no module there yet",
)
