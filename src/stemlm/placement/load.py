"""A checkpoint loaded for inference with its lookup tables placed: the one loader of offloaded tables.

    model, providers = load_offloaded_model("runs/tiny/checkpoints/step-000200", "host", table_dtype="int8")

The placement (`stemlm.placement.registry.choose(tables, "inference")`) decides everything that differs: a
placement that keeps the tables in the model (`offloaded` False: resident) loads the model whole and returns only
the token tables' `ResidentProvider`; an offloaded one (host, mmap, or one registered by a user) gets the model
built on the meta device, every weights file's header checked (a truncated or missing file is named before any
weight is read), the backbone loaded onto the device with each table left a meta placeholder (the tables never
occupy device memory), and is asked for one provider (`Placement.provider`) per group of tables, grouped by
family (`stemlm.offload.families`): the token tables together, the shared n-gram store together, each memory
layer's values (and each n-gram table of per-layer hashing) alone. Tests: tests/offload/test_offload_providers.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from stemlm.checkpoint.folder import load_config, weight_files
from stemlm.checkpoint.runs import from_pretrained
from stemlm.checkpoint.table_storage import SCALE_SUFFIX, check_table_dtype, read_storage
from stemlm.errors import StemlmError
from stemlm.model.decoder import StemLM
from stemlm.model.kinds.registry import FAMILIES
from stemlm.offload.compact import RowSource
from stemlm.offload.families import OffloadProviders, round_tables, table_families
from stemlm.offload.providers import ResidentProvider, TableProvider, _load_backbone, checked_tables, checkpoint_entries
from stemlm.placement.base import INFERENCE, StoredTables
from stemlm.placement.registry import choose


def load_offloaded_model(
    directory: str | Path,
    tables: str = "host",
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    layout: str = "token",
    table_dtype: str | None = None,
) -> tuple[StemLM, OffloadProviders]:
    """A checkpoint's model with its lookup tables placed by `--tables tables`, and their providers.

    `table_dtype` (fp32 / bf16 / int8; None: as the checkpoint stores them) is the format the rows are kept in
    (`stemlm.offload.compact`): the placement converts to it or refuses (mmap reads the file's own format);
    resident tables are rounded through it and held in the model's dtype (no memory saved)."""
    placement = choose(tables, INFERENCE)
    if table_dtype is not None:
        check_table_dtype(table_dtype)
    device = torch.device(device)
    storage = read_storage(directory)
    stored = storage["dtype"] if storage else "fp32"
    want = table_dtype or stored
    placement.check_row_format(stored, want)
    if not placement.offloaded:
        model = from_pretrained(directory, device=device, dtype=dtype)
        if want != stored:
            round_tables(model, want)
        return model, OffloadProviders(token=ResidentProvider(model) if model.token_tables() else None)
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
    compact = set(storage["tensors"]) if storage else set()

    def source(name: str, entry) -> RowSource:
        scale = entries.get(name + SCALE_SUFFIX) if name in compact and stored == "int8" else None
        if name in compact and stored == "int8" and scale is None:
            raise StemlmError(f"checkpoint {directory}: int8 table {name} has no scales {name}{SCALE_SUFFIX}")
        return RowSource(entry, scale)

    def provider(layer_names: dict[int, str], layer_layout: str) -> TableProvider:
        placed = checked_tables(directory, entries, model, layer_names)
        rows = StoredTables(
            directory=Path(directory),
            entries=placed,
            stored=stored,
            want=want,
            plain=not storage,
            layout=layer_layout,
            pin=device.type == "cuda",  # staging buffers only; see HostProvider
            dtype=dtype,
            make_sources=lambda: {layer: source(layer_names[layer], entry) for layer, entry in placed.items()},
        )
        return placement.provider(rows)

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
