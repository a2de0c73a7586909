"""Offloading every lookup table of a model, by family: token tables, hashed n-gram tables, memory values.

- `token`: the STEM / STEM-gate / PLE tables (and the U_l of `stem_ngram`), keyed by token id; one
  token-major provider and row cache for all layers (see `stemlm.offload.providers`).
- `ngram`: the hashed n-gram tables of `stem_ngram` / `engram`. Every n-gram layer of a model looks up the
  same row ids (the hash is shared), so they too form one token-major provider over Σ prime sizes rows, with
  their own hot-row cache; the ids depend on the input ids alone, so each step's rows are prefetched.
- `memory`: the value tables of product-key memory layers. Their ids come out of the layer's own top-k, so
  nothing can be fetched before the layer runs and every layer reads different ids: one provider and cache
  per layer, fetched on demand on the critical path of the forward (see `stemlm.offload.lookup_rows`).

`load_offloaded_model(dir, "host" | "mmap" | "resident")` loads the backbone onto the device and leaves every
offloaded table a meta placeholder; `resident` loads everything and returns no providers but the token one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from stemlm.checkpoint import load_config, weight_files
from stemlm.errors import StemlmError
from stemlm.model.decoder import StemLM
from stemlm.offload.compact import CompactProvider
from stemlm.offload.providers import (
    TABLE_MODES,
    HostProvider,
    MmapProvider,
    ResidentProvider,
    TableProvider,
    _load_backbone,
    checked_tables,
    checkpoint_entries,
)
from stemlm.runs import from_pretrained


@dataclass
class OffloadProviders:
    token: TableProvider | None = None
    ngram: TableProvider | None = None
    memory: dict[int, TableProvider] = field(default_factory=dict)

    def all(self) -> dict[str, TableProvider]:
        """Every provider by a display name: token, ngram, memory.<layer>."""
        named = {"token": self.token, "ngram": self.ngram, **{f"memory.{i}": p for i, p in self.memory.items()}}
        return {name: p for name, p in named.items() if p is not None}


def table_families(model: StemLM) -> dict[str, dict[int, str]]:
    """Family -> {layer: parameter name} of the model's lookup tables (empty families left out)."""
    names = {id(p): n for n, p in model.named_parameters()}
    families = {
        "token": model.stem_tables(),
        "ngram": model.ngram_tables(),
        "memory": model.memory_tables(),
    }
    out = {family: {i: names[id(t.weight)] for i, t in tables.items()} for family, tables in families.items()}
    return {family: tables for family, tables in out.items() if tables}


def load_offloaded_model(
    directory: str | Path,
    tables: str = "host",
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    layout: str = "token",
    table_dtype: str = "fp32",
) -> tuple[StemLM, OffloadProviders]:
    """A checkpoint's model with its lookup tables placed by `tables`, and their providers; `table_dtype` bf16 /
    int8 stores host tables compactly (stemlm.offload.compact)."""
    if table_dtype != "fp32" and tables != "host":
        raise StemlmError(f"table dtype {table_dtype} needs tables='host' (got {tables!r})")
    if tables not in TABLE_MODES:
        raise StemlmError(f"unknown table placement {tables!r}; choose one of {', '.join(TABLE_MODES)}")
    device = torch.device(device)
    if tables == "resident":
        model = from_pretrained(directory, device=device, dtype=dtype)
        return model, OffloadProviders(token=ResidentProvider(model) if model.stem_tables() else None)
    config = load_config(directory)
    with torch.device("meta"):
        model = StemLM(config)
    families = table_families(model)
    if not families:
        raise StemlmError(f"checkpoint {directory} has no lookup tables to offload; load it with tables='resident'")
    files = weight_files(directory)
    entries = checkpoint_entries(files)
    pin = device.type == "cuda"

    def provider(layer_names: dict[int, str], layer_layout: str) -> TableProvider:
        placed = checked_tables(directory, entries, model, layer_names)
        if tables == "host":
            host = HostProvider(placed, layout=layer_layout, pin=pin, dtype=dtype)
            return host if table_dtype == "fp32" else CompactProvider(host, table_dtype, out_dtype=host.dtype)
        return MmapProvider(placed, dtype=dtype, pin=pin)

    providers = OffloadProviders(
        token=provider(families["token"], layout) if "token" in families else None,
        ngram=provider(families["ngram"], layout) if "ngram" in families else None,
        memory={i: provider({i: name}, "token") for i, name in families.get("memory", {}).items()},
    )
    skip = {name for layer_names in families.values() for name in layer_names.values()}
    _load_backbone(model, directory, files, skip, device, dtype)
    return model, providers
