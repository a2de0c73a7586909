"""The token-aware FFNs: dense SwiGLU, STEM, the STEM gate ablation and Gemma-3n-style PLE.

Every FFN takes the hidden states and a `TokenContext` carrying the input token ids of the positions being
computed. Table-owning FFNs look their rows up with those ids:

    stem:       y = down_proj( silu(gate_proj(x)) * U[t] )          (U replaces the up-projection)
    stem_gate:  y = down_proj( silu(G[t]) * up_proj(x) )            (the paper's worse ablation)
    ple:        y = dense(x) + ple_proj( silu(ple_gate(x)) * P[t] ) (a narrow side branch, nothing replaced)

`TokenContext.table_rows` is how code outside the model supplies rows (host offload, sharding, editing)
without touching the math: when set, it is called as `table_rows(layer_idx, input_ids)` instead of indexing
the layer's own table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from stemlm.errors import StemlmError
from stemlm.model.config import ModelConfig

TableRows = Callable[[int, torch.Tensor], torch.Tensor]
# (layer_idx, value ids [N, k]) -> (rows [U, width], positions [N, k] into rows): the rows fetched on demand
MemoryRows = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class TokenContext:
    """Per-forward state shared by the FFNs (one per call, so concurrent forwards never share it)."""

    input_ids: torch.Tensor  # [B, T] ids of the positions being computed (the inputs, not the targets)
    table_rows: TableRows | None = None  # external row source; None = each layer's own table
    aux_losses: list[torch.Tensor] = field(default_factory=list)  # MoE balancing / z-losses, summed by the model
    expert_counts: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> tokens routed per expert
    # --- n-gram, Engram and memory kinds (stemlm.model.ngram / engram / memory_layer) ---
    ngram_ids: torch.Tensor | None = None  # [B, T, K] hashed n-gram row ids, computed from the ids before compute
    ngram_rows: TableRows | None = None  # external source of n-gram rows: (layer_idx, ngram_ids) -> [B, T, K, w]
    memory_rows: MemoryRows | None = None  # external value rows of memory layers (fetched on demand)
    state: dict | None = None  # the decoding state of earlier positions (ids, Engram conv inputs); None: no cache
    past_len: int = 0  # positions already in the cache
    valid: torch.Tensor | None = None  # [B, T] bool, False at left-padding positions; None: all real


def lookup(table: nn.Embedding, ctx: TokenContext, layer_idx: int) -> torch.Tensor:
    """The rows of the input ids, [B, T, width]: from `table` itself, or from `ctx.table_rows` when one is set."""
    if ctx.table_rows is None:
        return table(ctx.input_ids)
    rows = ctx.table_rows(layer_idx, ctx.input_ids)
    expected = (*ctx.input_ids.shape, table.embedding_dim)
    if tuple(rows.shape) != expected:
        # Checked here because a wrong width would otherwise surface as a broadcasting error deep in the FFN.
        raise StemlmError(
            f"table_rows returned shape {list(rows.shape)} for layer {layer_idx}; expected {list(expected)} "
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

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ctx: TokenContext | None = None) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class StemFFN(nn.Module):
    """STEM: the up-projection replaced by a per-layer table indexed by the input token id."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.stem_embedding = token_table(config.vocab_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, ctx: TokenContext) -> torch.Tensor:
        up = lookup(self.stem_embedding, ctx, self.layer_idx)  # U_l[t], t = the input id at each position
        return self.down_proj(F.silu(self.gate_proj(x)) * up.to(x.dtype))


class StemGateFFN(nn.Module):
    """Ablation: the gate replaced by a context-free table, the up-projection kept."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.stem_embedding = token_table(config.vocab_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, ctx: TokenContext) -> torch.Tensor:
        gate = lookup(self.stem_embedding, ctx, self.layer_idx)  # G_l[t]
        return self.down_proj(F.silu(gate.to(x.dtype)) * self.up_proj(x))


class PLEFFN(nn.Module):
    """Gemma-3n-style per-layer embedding: a narrow token table gated by the hidden state, beside a dense FFN."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        d, w = config.hidden_size, config.ple_dim
        self.gate_proj = nn.Linear(d, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, d, bias=False)
        self.ple_gate = nn.Linear(d, w, bias=False)
        self.ple_proj = nn.Linear(w, d, bias=False)
        self.ple_embedding = token_table(config.vocab_size, w)

    def forward(self, x: torch.Tensor, ctx: TokenContext) -> torch.Tensor:
        rows = lookup(self.ple_embedding, ctx, self.layer_idx)  # P_l[t]
        dense = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return dense + self.ple_proj(F.silu(self.ple_gate(x)) * rows.to(x.dtype))


def table_of(ffn: nn.Module) -> nn.Embedding | None:
    """The token table of a table-owning FFN (stem, stem_gate, ple), else None."""
    for name in ("stem_embedding", "ple_embedding"):
        table = getattr(ffn, name, None)
        if isinstance(table, nn.Embedding):
            return table
    return None
