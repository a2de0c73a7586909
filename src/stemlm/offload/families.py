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

`load_offloaded_model(dir, "host" | "mmap" | "device")` (a `stemlm.runtime` table placement; "resident" is
"device") loads the backbone onto the device and leaves every offloaded table a meta placeholder; `device` loads
everything and returns no providers but the token one (kind "resident").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from stemlm.checkpoint.folder import load_config, weight_files
from stemlm.checkpoint.runs import from_pretrained
from stemlm.checkpoint.table_storage import SCALE_SUFFIX, check_table_dtype, read_storage
from stemlm.errors import StemlmError
from stemlm.model.decoder import StemLM
from stemlm.model.kinds.registry import FAMILIES
from stemlm.offload.compact import CompactMmapProvider, CompactProvider, RowSource
from stemlm.offload.providers import (
    HostProvider,
    MmapProvider,
    ResidentProvider,
    TableProvider,
    _load_backbone,
    checked_tables,
    checkpoint_entries,
)
from stemlm.runtime import DEVICE, table_placement


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


def load_offloaded_model(
    directory: str | Path,
    tables: str = "host",
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    layout: str = "token",
    table_dtype: str | None = None,
) -> tuple[StemLM, OffloadProviders]:
    """A checkpoint's model with its lookup tables placed by `tables`, and their providers.

    `table_dtype` (fp32 / bf16 / int8; None: as the checkpoint stores them) is the format the rows are kept in
    (`stemlm.offload.compact`): host tables are converted to it on load, mmap tables are read in the format
    the file has (another one is refused: `stemlm convert CKPT --table-dtype` stores them so), resident
    tables are rounded through it and held in the model's dtype (no memory saved)."""
    tables = table_placement(tables)
    if table_dtype is not None:
        check_table_dtype(table_dtype)
    device = torch.device(device)
    storage = read_storage(directory)
    stored = storage["dtype"] if storage else "fp32"
    want = table_dtype or stored
    if tables == DEVICE:
        model = from_pretrained(directory, device=device, dtype=dtype)
        if want != stored:
            round_tables(model, want)
        return model, OffloadProviders(token=ResidentProvider(model) if model.token_tables() else None)
    if tables == "mmap" and want != stored:
        raise StemlmError(
            f"--tables mmap reads the rows in the format the checkpoint stores ({stored}); to map {want} rows, "
            f"store them so first: stemlm convert CKPT --table-dtype {want} --out DIR (or use --tables host)"
        )
    from stemlm.checkpoint.sharded import is_sharded

    if is_sharded(directory):
        raise StemlmError(
            f"checkpoint {directory} is sharded (stemlm train --nproc); --tables {tables} reads a plain model "
            f"folder: write one with stemlm export {directory} --out DIR (or use --tables resident)"
        )
    config = load_config(directory)
    with torch.device("meta"):
        model = StemLM(config)
    families = table_families(model)
    if not families:
        raise StemlmError(f"checkpoint {directory} has no lookup tables to offload; load it with tables='resident'")
    # The shared n-gram store is token-major over one set of ids; per-layer hashing gives each layer its own ids
    # (and row count), so its tables are stored and cached one per layer, as the memory values are.
    ngram_per_layer = "ngram" in families and not model.ngram_hasher.shared

    def per_layer(family: str) -> bool:
        return FAMILIES[family].cache == "per-layer" or (family == "ngram" and ngram_per_layer)

    files = weight_files(directory)
    entries = checkpoint_entries(files)
    pin = device.type == "cuda"  # staging buffers only; see HostProvider
    compact = set(storage["tensors"]) if storage else set()

    def source(name: str, entry) -> RowSource:
        scale = entries.get(name + SCALE_SUFFIX) if name in compact and stored == "int8" else None
        if name in compact and stored == "int8" and scale is None:
            raise StemlmError(f"checkpoint {directory}: int8 table {name} has no scales {name}{SCALE_SUFFIX}")
        return RowSource(entry, scale)

    def provider(layer_names: dict[int, str], layer_layout: str) -> TableProvider:
        placed = checked_tables(directory, entries, model, layer_names)
        if not storage and want == "fp32":  # the ordinary format: fp32 rows as the file has them
            if tables == "host":
                return HostProvider(placed, layout=layer_layout, pin=pin, dtype=dtype)
            return MmapProvider(placed, dtype=dtype, pin=pin)
        sources = {layer: source(layer_names[layer], entry) for layer, entry in placed.items()}
        if tables == "host":
            return CompactProvider(sources, want, out_dtype=dtype or torch.float32, pin=pin)
        return CompactMmapProvider(sources, out_dtype=dtype or torch.float32, pin=pin)

    shared = {f: provider(names, layout) for f, names in families.items() if not per_layer(f)}
    layered = {
        f: {i: provider({i: name}, "token") for i, name in names.items()}
        for f, names in families.items()
        if per_layer(f)
    }
    providers = OffloadProviders(
        token=shared.get("token"),
        ngram=shared.get("ngram"),
        memory=layered.get("memory", {}),
        ngram_layers=layered.get("ngram", {}),
    )
    skip = {name for layer_names in families.values() for name in layer_names.values()}
    skip |= {name + SCALE_SUFFIX for name in compact}
    _load_backbone(model, directory, files, skip, device, dtype)
    return model, providers


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
