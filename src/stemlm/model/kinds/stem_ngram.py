"""`stem_ngram`: STEM whose up-projection row is keyed by the token and the hashed n-grams ending at it.

    y = down_proj( silu(gate_proj(x)) * (U_l[t] + Σ_k H_l[id_k(t_{-n+1..0})]) )

`U_l` is a `token` table like STEM's; `H_l` an `ngram` table over the hashed n-gram ids of `stemlm.model.ngram`
(the same ids in every layer, known from the input ids alone: prefetched when offloaded). Edits swap U_l[t]
only; the n-gram rows of an edited position stay those of the original ids (`KIND.edit_note`).
"""

from __future__ import annotations

import torch
from torch import nn

from stemlm.model.ffn import TokenContext, lookup, token_table
from stemlm.model.kinds.registry import Config, Field, Kind, LayerCount, Table
from stemlm.model.ngram import ngram_hasher, ngram_lookup
from stemlm.model.ngram_layout import check_orders, ngram_layout

EDIT_NOTE = (
    "this model adds hashed n-gram rows to its STEM rows: the edit swaps the token rows U_l[t] only; the n-gram "
    "rows of the edited positions are still those of the original ids"
)


class StemNgramFFN(nn.Module):
    """STEM with the up-projection row U[t] plus the rows of the hashed n-grams ending at t."""

    def __init__(self, config: Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        hasher = ngram_hasher(config)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.stem_embedding = token_table(config.vocab_size, config.intermediate_size)
        self.ngram_embedding = token_table(hasher.num_rows, config.intermediate_size)

    def init_stds(self) -> dict[int, float]:
        # Zero n-gram rows: the layer starts as plain STEM and learns what the n-grams add.
        return {id(self.ngram_embedding.weight): 0.0}

    def forward(self, x: torch.Tensor, ctx: TokenContext) -> torch.Tensor:
        up = lookup(self.stem_embedding, ctx, self.layer_idx)  # U_l[t]; positional edits act here
        up = up + ngram_lookup(self.ngram_embedding, ctx, self.layer_idx).sum(dim=-2)  # + Σ_k H_l[id_k]
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * up.to(x.dtype))


def count(config: Config, layer_idx: int) -> LayerCount:
    d, f = config.hidden_size, config.intermediate_size
    layout = ngram_layout(config)
    params = {"stem_proj": 2 * d * f, "token_tables": config.vocab_size * f, "ngram_tables": layout.num_rows * f}
    return LayerCount(params, {"stem_proj": 2 * d * f}, f * (1 + layout.num_keys))  # U[t] + one row a key


def check(config: Config, need) -> None:
    check_orders("stem_ngram_orders", config.stem_ngram_orders, need)


KIND = Kind(
    name="stem_ngram",
    order=60,
    summary="STEM with U_l[t] plus the rows of the hashed n-grams ending at t",
    build=StemNgramFFN,
    count=count,
    fields=(
        Field("stem_ngram_orders", "str", "2", 'n-gram orders added to U[t]: "2" (bigrams) or "2,3"'),
        Field("stem_ngram_heads", "int", 2, "hash heads per order, each with its own prime-sized table", positive=True),
        Field(
            "stem_ngram_rows",
            "int | None",
            None,
            "rows per head (rounded up to a prime); None: vocab_size",
            positive=True,
        ),
    ),
    check=check,
    tables=(Table("token", "stem_embedding"), Table("ngram", "ngram_embedding")),
    components=("stem_proj", "token_tables", "ngram_tables"),
    table_components=("token_tables", "ngram_tables"),
    ngram=lambda config: (config.stem_ngram_orders, config.stem_ngram_heads, config.stem_ngram_rows),
    replaces_projection=True,
    edit_note=EDIT_NOTE,
    vllm_unserved=None,
)
