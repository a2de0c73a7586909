"""Offloading every lookup table of a model, by family (`stemlm.model.kinds.registry.FAMILIES`).

A kind declares which family each of its tables is in; the family decides how it is offloaded:
- `token` (STEM, STEM-gate, PLE tables, the U_l of `stem_ngram`, ...): keyed by token id; one token-major
  provider and row cache for all layers (see `stemlm.offload.providers`), prefetched.
- `ngram` (the hashed n-gram tables of `stem_ngram` / `engram`): every n-gram layer of a model looks up the
  same row ids (the hash is shared), so they too form one token-major provider over Σ prime sizes rows, with
  their own hot-row cache; the ids depend on the input ids alone, so each step's rows are prefetched.
  Per-layer hashing (`engram_variant=reference`: every layer its own multipliers and prime table sizes) gives
  each n-gram layer other ids and another row count, so there each n-gram table is a provider and cache of its
  own (`OffloadProviders.ngram_layers`, by table key); its ids are still known from the input ids, so they are
  prefetched too, one pipeline per layer (`stemlm.offload.lookup_rows.LayerPipelines`).
- `memory` (product-key memory values): their ids come out of the layer's own top-k, so nothing can be
  fetched before the layer runs and every layer reads different ids: one provider and cache per layer,
  fetched on demand on the critical path of the forward (see `stemlm.offload.lookup_rows`).

`stemlm.placement.load.load_offloaded_model(dir, "host" | "mmap" | "resident")` groups a checkpoint's tables by
these families and asks the table placement for one provider per group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stemlm.model.decoder import StemLM
from stemlm.offload.providers import TableProvider


@dataclass
class OffloadProviders:
    token: TableProvider | None = None
    ngram: TableProvider | None = None
    memory: dict[int, TableProvider] = field(default_factory=dict)
    ngram_layers: dict[int, TableProvider] = field(default_factory=dict)  # per-layer hashing: table key -> provider

    def all(self) -> dict[str, TableProvider]:
        """Every provider by a display name: token, ngram, ngram.<key> (per-layer hashing), memory.<layer>."""
        named = {"token": self.token, "ngram": self.ngram, **{f"ngram.{i}": p for i, p in self.ngram_layers.items()}}
        named |= {f"memory.{i}": p for i, p in self.memory.items()}
        return {name: p for name, p in named.items() if p is not None}


def table_families(model: StemLM) -> dict[str, dict[int, str]]:
    """Family -> {layer: parameter name} of the model's lookup tables (empty families left out)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        family: {i: names[id(t.weight)] for i, t in tables.items()} for family, tables in model.lookup_tables().items()
    }


@torch.no_grad()
def round_tables(model: StemLM, table_dtype: str) -> None:
    """Replace every lookup table's rows by what they read back as after storing them as `table_dtype`
    (resident tables with `--table-dtype`: the effect on the model's outputs, at the model's own dtype)."""
    from stemlm.checkpoint.table_storage import round_rows

    for tables in model.lookup_tables().values():
        for table in tables.values():
            weight = table.weight
            for start in range(0, weight.shape[0], 4096):
                weight[start : start + 4096] = round_rows(weight[start : start + 4096], table_dtype)
