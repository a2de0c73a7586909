"""The building blocks every kind shares: the per-forward `TokenContext`, table lookups, `token_table`, `DenseFFN`.

A kind's module (`stemlm.model.kinds`) takes the hidden states and a `TokenContext` carrying the input token ids
of the positions being computed. Table-owning kinds look their rows up through `lookup`, which is how code
outside the model supplies rows (host offload, sharding, editing) without touching the math: the forward's
`rows={family: provider}` mapping (see `stemlm.model.kinds.registry.FAMILIES`) lands in `ctx.rows`, and when
the table's family has a provider it is called as `provider(key, input_ids)` instead of indexing the table.
The key is the layer index of the layer that owns the table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from stemlm.errors import StemlmError
from stemlm.model.kinds.registry import FAMILIES

TableRows = Callable[[int, torch.Tensor], torch.Tensor]
# (layer_idx, value ids [N, k]) -> (rows [U, width], positions [N, k] into rows): the rows fetched on demand
MemoryRows = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# family -> provider: "token" and "ngram" take TableRows, "memory" a MemoryRows, "embed" an EmbedRows
Rows = Mapping[str, Callable | None]
EmbedRows = Callable[[torch.Tensor], torch.Tensor]  # input_ids [B, T] -> input embeddings [B, T, hidden]
EMBED = "embed"  # the rows= key of the input embeddings (not a table family of the layers)


@dataclass
class TokenContext:
    """Per-forward state shared by the layers (one per call, so concurrent forwards never share it)."""

    input_ids: torch.Tensor  # [B, T] ids of the positions being computed (the inputs, not the targets)
    rows: dict[str, Callable] = field(default_factory=dict)  # family -> external row source; absent = own tables
    aux_losses: list[torch.Tensor] = field(default_factory=list)  # MoE balancing / z-losses, summed by the model
    expert_counts: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> tokens routed per expert
    # [B, T, K] hashed n-gram row ids, computed from the ids before compute (per-layer hashing: layer -> those ids)
    ngram_ids: torch.Tensor | dict[int, torch.Tensor] | None = None
    state: dict | None = None  # the decoding state of earlier positions (ids, Engram conv inputs); None: no cache
    past_len: int = 0  # positions already in the cache
    valid: torch.Tensor | None = None  # [B, T] bool, False at left-padding positions; None: all real
    embeddings: torch.Tensor | None = None  # [B, T, hidden] the input embeddings (PLE's per-layer input reads them)


def checked_rows(rows: Rows | None) -> dict[str, Callable]:
    """The providers of a forward's `rows=` mapping (None entries dropped), refusing families nobody declares."""
    out = {family: provider for family, provider in (rows or {}).items() if provider is not None}
    unknown = sorted(set(out) - set(FAMILIES) - {EMBED})
    if unknown:
        raise StemlmError(f"rows= names unknown table families {unknown}; families: {', '.join((*FAMILIES, EMBED))}")
    return out


def lookup(table: nn.Embedding, ctx: TokenContext, layer_idx: int) -> torch.Tensor:
    """Token rows of the input ids, [B, T, width]: from `table` itself, or from `ctx.rows["token"]` when set."""
    provider = ctx.rows.get("token")
    if provider is None:
        return table(ctx.input_ids)
    rows = provider(layer_idx, ctx.input_ids)
    expected = (*ctx.input_ids.shape, table.embedding_dim)
    if tuple(rows.shape) != expected:
        # Checked here because a wrong width would otherwise surface as a broadcasting error deep in the FFN.
        raise StemlmError(
            f"rows['token'] returned shape {list(rows.shape)} for layer {layer_idx}; expected {list(expected)} "
            "([batch, seq_len, table width])"
        )
    return rows


def token_table(num_tokens: int, width: int) -> nn.Embedding:
    """An uninitialised [num_tokens, width] lookup table (`StemLM.init_weights` initialises every table).

    nn.Embedding would otherwise draw N(0, 1) in its constructor: wasted work for large tables, and on the
    meta device that draw imports torch._dynamo, which costs seconds at the start of every process.
    """
    return nn.Embedding(num_tokens, width, _weight=torch.empty(num_tokens, width))


class DenseFFN(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x))."""

    fusable = (("gate_proj", "up_proj"),)  # one product for decoding (stemlm.model.fusion)

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ctx: TokenContext | None = None) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
