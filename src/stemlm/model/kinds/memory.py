"""`memory`: a product-key memory layer in place of the FFN ("Memory Layers at Scale", arXiv 2412.09764).

Per head h (of `memory_heads`), with n = `memory_keys` sub-keys per half and k = `memory_topk`:

    q = W_q x                                 split into halves q1, q2 of memory_key_dim / 2
    s1 = q1 K1_hᵀ, s2 = q2 K2_hᵀ              two sub-key tables of n keys each (n² product keys)
    top-k of s1 and of s2, the k² sums s1_i + s2_j, their top-k -> value ids i·n + j, scores s
    m = Σ_h Σ_top-k softmax(s) · V[id]        the [n², d] value table read with EmbeddingBag (mode sum)
    y = W_out( m ⊙ silu(W_gate x) )           the paper's SiLU-gated output

The value ids depend on the hidden state, so unlike STEM or n-gram rows they cannot be known before the layer runs:
`model(..., rows={"memory": fn})` (a `memory` family table) lets offload fetch them on demand (`fn(layer_idx, ids [N,
h·k]) -> (rows [U, d], positions [N, h·k])`), on the critical path of the forward. FLOPs (matmuls only): the query
projection, the sub-key scores (every key entry is one MAC per token) and W_gate, W_out. The top-k, the k²
candidate sums and the weighted EmbeddingBag sum of h·k rows are not matmuls and are not counted (nor does
FlopCounterMode count them).

`memory_variant` picks between two functions of the same structure:
- "stemlm" (the default): no biases, every memory layer its own value table, keys N(0, (dk/2)^-½), the query,
  gate and output projections N(0, initializer_range).
- "reference": facebookresearch/memory's `lingua/product_key/memory.py` `HashingMemory` with its defaults (the
  reference read there, written anew): biases on the query (W_q x + b_q), on W_gate and on W_out (its
  `swilu_projection` and `value_proj`); one value table shared by every memory layer (its `mem_share_values`:
  the first memory layer holds it, the others read it under that layer's key, `table_owner`); its inits: keys
  U(±1/√dk), values N(0, d^-½), W_q xavier-uniform, W_gate and W_out N(0, d^-½), each bias U(±1/√fan-in) (the
  nn.Linear default it keeps). docs/kinds.md lists what still differs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stemlm.errors import StemlmError
from stemlm.model.ffn import TokenContext
from stemlm.model.kinds.registry import Config, Field, Kind, LayerCount, Table, Uniform, table_key

VARIANTS = ("stemlm", "reference")


def is_reference(config: Config) -> bool:
    return config.memory_variant == "reference"


def table_owner(config: Config, layer_idx: int) -> int:
    """The layer whose module holds the value table `layer_idx` reads: the first memory layer under the reference
    variant (one table for all), else the layer itself."""
    return config.special_layers[0] if is_reference(config) else layer_idx


class MemoryFFN(nn.Module):
    def __init__(self, config: Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        d, h, dk, n = config.hidden_size, config.memory_heads, config.memory_key_dim, config.memory_keys
        self.heads, self.num_keys, self.topk = h, n, config.memory_topk
        self.reference = is_reference(config)
        owner = table_owner(config, layer_idx)
        self.table_key = table_key(config, owner)  # the key rows are asked for under (the owner's when shared)
        self.memory_query = nn.Linear(d, h * dk, bias=self.reference)
        # [heads, 2 halves, n keys, dk / 2]; uninitialised here, StemLM.init_weights draws them.
        self.memory_keys = nn.Parameter(torch.empty(h, 2, n, dk // 2))
        if owner == layer_idx:  # a sharing layer's table is set by the decoder (the owner's, unregistered here)
            self.memory_values = nn.EmbeddingBag(n * n, d, mode="sum", _weight=torch.empty(n * n, d))
        self.memory_gate = nn.Linear(d, d, bias=self.reference)
        self.memory_out = nn.Linear(d, d, bias=self.reference)

    def init_stds(self) -> dict[int, float | Uniform]:
        d = self.memory_gate.in_features
        own = {} if "memory_values" not in self._modules else {id(self.memory_values.weight): d**-0.5}
        if not self.reference:
            # Keys ~ 1/sqrt(fan-in) so the scores start O(1); values ~ 1/sqrt(d) as in the PKM reference setup.
            return {id(self.memory_keys): self.memory_keys.shape[-1] ** -0.5, **own}
        # The reference's reset_parameters; the biases keep nn.Linear's U(±1/√fan-in), which it leaves in place.
        query = self.memory_query.weight
        return {
            id(query): Uniform((6 / (query.shape[0] + query.shape[1])) ** 0.5),  # xavier-uniform
            id(self.memory_query.bias): Uniform(d**-0.5),
            id(self.memory_keys): Uniform((2 * self.memory_keys.shape[-1]) ** -0.5),  # 1/√dk, dk the whole query
            **own,
            id(self.memory_gate.weight): d**-0.5,
            id(self.memory_gate.bias): Uniform(d**-0.5),
            id(self.memory_out.weight): d**-0.5,
            id(self.memory_out.bias): Uniform(d**-0.5),
        }

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Value ids and weights of every position of x [N, d]: ([N, h·k] int64, [N, h·k] softmax weights)."""
        N, k, n = x.shape[0], self.topk, self.num_keys
        q = self.memory_query(x).view(N, self.heads, 2, -1).permute(1, 2, 0, 3)  # [h, 2, N, dk/2]
        scores = torch.matmul(q, self.memory_keys.to(q.dtype).transpose(-1, -2))  # [h, 2, N, n]
        s1, i1 = scores[:, 0].topk(k, dim=-1)  # [h, N, k]
        s2, i2 = scores[:, 1].topk(k, dim=-1)
        sums = (s1[..., :, None] + s2[..., None, :]).flatten(-2)  # the k² candidate product keys
        ids = (i1[..., :, None] * n + i2[..., None, :]).flatten(-2)
        best, pos = sums.topk(k, dim=-1)
        weights = torch.softmax(best.float(), dim=-1)
        ids = ids.gather(-1, pos)
        return ids.permute(1, 0, 2).reshape(N, -1), weights.permute(1, 0, 2).reshape(N, -1)

    def forward(self, x: torch.Tensor, ctx: TokenContext) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        ids, weights = self.select(flat)
        provider = ctx.rows.get("memory")
        if provider is None:
            weights = weights.to(self.memory_values.weight.dtype)
            memory = self.memory_values(ids, per_sample_weights=weights)
        else:
            rows, positions = provider(self.table_key, ids)
            if tuple(positions.shape) != tuple(ids.shape) or rows.shape[-1] != self.memory_values.embedding_dim:
                raise StemlmError(
                    f"rows['memory'] returned rows {list(rows.shape)} / positions {list(positions.shape)}"
                )
            memory = F.embedding_bag(positions, rows, per_sample_weights=weights.to(rows.dtype), mode="sum")
        out = self.memory_out(memory.to(x.dtype) * F.silu(self.memory_gate(flat)))
        return out.reshape(shape)


def count(config: Config, layer_idx: int) -> LayerCount:
    d, h, dk, n, k = (
        config.hidden_size,
        config.memory_heads,
        config.memory_key_dim,
        config.memory_keys,
        config.memory_topk,
    )
    # query d -> h·dk, the sub-keys (each entry one MAC per token), W_gate and W_out d -> d
    proj = d * h * dk + h * n * dk + 2 * d * d
    biases = h * dk + 2 * d if is_reference(config) else 0  # added, not multiplied: no FLOPs
    values = {"memory_values": n * n * d} if table_owner(config, layer_idx) == layer_idx else {}
    # h·k value rows read per token and layer (distinct in each head; heads may repeat a row), shared table or not
    return LayerCount({"memory_proj": proj + biases, **values}, {"memory_proj": proj}, h * k * d)


def check(config: Config, need) -> None:
    need(
        config.memory_variant in VARIANTS,
        f"memory_variant={config.memory_variant!r} is not one of {', '.join(VARIANTS)}",
    )
    need(config.memory_key_dim % 2 == 0, f"memory_key_dim={config.memory_key_dim} must be even (two halves)")
    need(
        config.memory_topk <= config.memory_keys,
        f"memory_topk={config.memory_topk} exceeds memory_keys={config.memory_keys}",
    )


KIND = Kind(
    name="memory",
    order=80,
    summary="product-key memory layer: top-k of n² keys, SiLU-gated sum of their value rows",
    build=MemoryFFN,
    count=count,
    fields=(
        Field("memory_keys", "int", 128, "sub-keys per half: memory_keys² value rows", positive=True),
        Field("memory_topk", "int", 16, "value rows read per head", positive=True),
        Field("memory_heads", "int", 4, "memory heads", positive=True),
        Field("memory_key_dim", "int", 64, "query width per head (two halves of memory_key_dim / 2)", positive=True),
        Field(
            "memory_variant",
            "str",
            "stemlm",
            "stemlm (no biases, a value table per layer) or reference (facebookresearch/memory's: biases, one "
            "shared value table, its inits)",
        ),
    ),
    check=check,
    tables=(Table("memory", "memory_values", owner=table_owner),),
    components=("memory_proj", "memory_values"),
    table_components=("memory_values",),
    vllm_unserved=(
        "fits vLLM's step (a per-token top-k over product keys and a weighted sum of value rows) but has "
        "no module there yet"
    ),
)
