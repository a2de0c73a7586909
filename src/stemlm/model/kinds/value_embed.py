"""`value_embed`: modded-nanogpt's value embeddings, token-indexed rows mixed into attention's value vectors.

In each selected layer, on the value vectors of attention (before it attends, and before the KV cache keeps them):

    v_t <- λ0 · v_t + λ1 · VE[t]         VE: [vocab_size, kv_heads · head_dim], t the input id; λ learned per layer

The layer's FFN stays a dense SwiGLU. `value_embed_tables` = n shares the tables: the j-th selected layer uses
table j mod n (six layers and n = 3 give modded-nanogpt's 0 1 2 ... 0 1 2); None gives every layer its own. A
shared table is held by the first layer that uses it (`model.layers.<owner>.mlp.value_embedding.weight`); the
others read it under the owner's index. VE is a `token` table (stemlm.model.kinds.registry.FAMILIES), so it is
prefetched when offloaded, row-sharded under `--nproc`, trained row-sparsely and edited like a STEM table.

From KellerJordan/modded-nanogpt's `train_gpt.py` (the idea read there, written anew). Differences: λ start at
(1, 1), so a layer starts as its dense twin plus the row (modded-nanogpt starts at (0.5, 0.5)); VE takes
`table_init` like every token table; layers without a table stay plain (modded-nanogpt scales their v by λ0).
Accounting: the mix is elementwise (no FLOPs counted, as FlopCounterMode counts none); a token reads one row
per table, so a shared table's row counts once; the two λ per layer are `value_mix` parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stemlm.model.ffn import TokenContext, lookup, token_table
from stemlm.model.kinds.registry import Config, Field, Kind, LayerCount, Table


def table_owner(config: Config, layer_idx: int) -> int:
    """The layer whose module holds the value table that `layer_idx` reads."""
    layers = config.special_layers
    return layers[layers.index(layer_idx) % (config.value_embed_tables or len(layers))]


class ValueEmbedFFN(nn.Module):
    """A dense SwiGLU at the FFN position, and `mix_values`, which the layer's attention calls on its values."""

    fusable = (("gate_proj", "up_proj"),)  # one product for decoding (stemlm.model.fusion)

    def __init__(self, config: Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx, self.table_layer = layer_idx, table_owner(config, layer_idx)
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        if self.table_layer == layer_idx:  # otherwise the decoder points `value_embedding` at the owner's table
            self.value_embedding = token_table(config.vocab_size, config.kv_heads * config.head_size)
        self.value_lambda = nn.Parameter(torch.empty(2))  # (λ0, λ1)

    def init_stds(self) -> dict[int, float | None]:
        return {id(self.value_lambda): None}  # None: ones

    def forward(self, x: torch.Tensor, ctx: TokenContext) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def mix_values(self, v: torch.Tensor, ctx: TokenContext) -> torch.Tensor:
        """v: [B, kv_heads, T, head_dim] -> λ0 · v + λ1 · VE[t], same shape."""
        B, H, T, D = v.shape
        rows = lookup(self.value_embedding, ctx, self.table_layer)  # [B, T, kv_heads · head_dim]
        ve = rows.to(v.dtype).reshape(B, T, H, D).transpose(1, 2)
        lam = self.value_lambda.to(v.dtype)
        return lam[0] * v + lam[1] * ve


def count(config: Config, layer_idx: int) -> LayerCount:
    d, f, width = config.hidden_size, config.intermediate_size, config.kv_heads * config.head_size
    params = {"ffn_dense": 3 * d * f, "value_mix": 2}
    owner = table_owner(config, layer_idx) == layer_idx
    if owner:
        params["value_tables"] = config.vocab_size * width
    return LayerCount(params, {"ffn_dense": 3 * d * f}, width if owner else 0)


def check(config: Config, need) -> None:
    if config.ffn == "value_embed" and config.value_embed_tables is not None:
        layers = len(config.special_layers)
        need(
            config.value_embed_tables <= layers,
            f"value_embed_tables={config.value_embed_tables} exceeds the {layers} layers in stem_layers",
        )


KIND = Kind(
    name="value_embed",
    order=100,
    summary="value embeddings (modded-nanogpt): attention's v <- λ0·v + λ1·VE[t], beside a dense FFN",
    build=ValueEmbedFFN,
    count=count,
    fields=(
        Field(
            "value_embed_tables",
            "int | None",
            None,
            "distinct value tables: the j-th selected layer uses table j mod n; None: one per layer",
            positive=True,
        ),
    ),
    check=check,
    tables=(Table("token", "value_embedding", owner=table_owner),),
    components=("ffn_dense", "value_tables", "value_mix"),
    table_components=("value_tables",),
    scalar_components=("value_mix",),
    acts_on_values=True,
    trains_with_tables=("value_lambda",),
)
