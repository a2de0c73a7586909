"""Compact table rows for inference: providers whose rows are stored as bf16 or row-wise int8.

    provider = CompactProvider.from_provider(HostProvider(...), "int8")   # quantise rows held elsewhere
    provider = CompactProvider(sources, "int8")      # from checkpoint entries (fp32, bf16 or int8 + scales)
    provider = CompactMmapProvider(sources)          # int8 / bf16 rows read straight from the mapped file

The row formats are `stemlm.checkpoint.table_storage`'s (int8: one scale per row and table layer, so one layer's large
entries do not coarsen another's). A *source* (`RowSource`) is one table layer's rows: a tensor, a safetensors
entry (F32 / BF16 / F16), or an int8 entry with its scale entry (a checkpoint written by `stemlm convert
--table-dtype int8`). `CompactProvider` holds the rows in host memory in its `table_dtype`, filling itself
block by block from the sources (never a full-precision copy of a table; int8 codes of an int8 source are
copied as they are, not re-quantised); `CompactMmapProvider` keeps the file's own format and reads the rows
on demand. Both dequantise the gathered rows on the host into `out_dtype` (into the pinned staging buffer on
CUDA), so the cache, the prefetcher and the model see ordinary rows. `stored_row_bytes` is what one token's
rows occupy in the store, i.e. what a decode step reads there per token missing from the cache:
W x 4 (fp32), W x 2 (bf16), W + 4 x layers (int8).
"""

from __future__ import annotations

import numpy as np
import torch

from stemlm.checkpoint.table_storage import (
    TABLE_DTYPES,
    TORCH_DTYPES,
    check_table_dtype,
    dequantize_rows,
    quantize_rows,
)
from stemlm.errors import StemlmError
from stemlm.offload.providers import ROW_BLOCK, TableProvider, TensorEntry, _as_torch, memmap_entry

__all__ = ["TABLE_DTYPES", "CompactMmapProvider", "CompactProvider", "RowSource", "dequantize_rows", "quantize_rows"]


class RowSource:
    """One table layer's rows [V, w]: a tensor, a safetensors entry, or int8 codes plus per-row scales."""

    def __init__(self, source: torch.Tensor | TensorEntry, scale: TensorEntry | torch.Tensor | None = None) -> None:
        self.tensor = source if isinstance(source, torch.Tensor) else None
        self.array = memmap_entry(source) if isinstance(source, TensorEntry) else None
        self.name = source.dtype if isinstance(source, TensorEntry) else None
        self.shape = tuple(source.shape)
        self.scale = None
        if scale is not None:
            self.scale = scale if isinstance(scale, torch.Tensor) else _as_torch(memmap_entry(scale), scale.dtype)
            if tuple(self.scale.shape) != (self.shape[0],) or self.scale.dtype != torch.float32:
                raise StemlmError(
                    f"int8 table scales must be F32 [{self.shape[0]}], got {self.scale.dtype} {list(self.scale.shape)}"
                )
        dtype = self.tensor.dtype if self.tensor is not None else None
        if self.name is not None:
            dtype = {"I8": torch.int8, "BF16": torch.bfloat16, "F16": torch.float16}.get(self.name, torch.float32)
        if (dtype == torch.int8) != (self.scale is not None):
            raise StemlmError("an int8 table needs its per-row scales, and only an int8 table has them")
        self.stored = "int8" if dtype == torch.int8 else "bf16" if dtype == torch.bfloat16 else "fp32"

    def _raw(self, index) -> torch.Tensor:
        if self.tensor is not None:
            return self.tensor[torch.as_tensor(index) if isinstance(index, np.ndarray) else index]
        return _as_torch(self.array[index], self.name)

    def codes(self, index) -> tuple[torch.Tensor, torch.Tensor]:
        """int8 codes and fp32 scales of the rows `index` (a slice or an int64 numpy array); int8 sources only."""
        return self._raw(index), self.scale[torch.as_tensor(index) if isinstance(index, np.ndarray) else index]

    def rows(self, index, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The rows `index` as values in `dtype` (dequantised when int8)."""
        if self.scale is not None:
            return dequantize_rows(*self.codes(index), dtype)
        return self._raw(index).to(dtype)


def _layer_widths(sources: dict[int, RowSource]) -> tuple[list[int], list[int], int]:
    layers = sorted(sources)
    if not layers:
        raise StemlmError("this model has no token tables to provide (its FFNs are all dense or MoE)")
    vocab = sources[layers[0]].shape[0]
    if any(sources[i].shape[0] != vocab for i in layers):
        raise StemlmError("the table layers of one provider must have the same number of rows")
    return layers, [sources[i].shape[1] for i in layers], vocab


class _Compact(TableProvider):
    """Shared: stored bytes and the dequantising gather over per-layer codes."""

    def _stored_bytes(self, element_size: int, int8: bool) -> int:
        return self.row_width * element_size + (4 * len(self.layers) if int8 else 0)

    @property
    def table_bytes(self) -> int:  # the bytes the tables occupy where they are kept (host memory or the file)
        return self.vocab_size * self.stored_row_bytes

    @property
    def host_bytes(self) -> int:
        return self.table_bytes


class CompactProvider(_Compact):
    """Rows held in host memory as `table_dtype` (fp32, bf16 or int8 + scales), served dequantised in `out_dtype`."""

    def __init__(
        self,
        sources: dict[int, RowSource | torch.Tensor],
        table_dtype: str,
        out_dtype: torch.dtype | None = None,
        pin: bool = False,
    ) -> None:
        check_table_dtype(table_dtype)
        sources = {i: s if isinstance(s, RowSource) else RowSource(s) for i, s in sources.items()}
        layers, widths, vocab = _layer_widths(sources)
        super().__init__(vocab, layers, widths, out_dtype or torch.float32)
        self.table_dtype, self.pin = table_dtype, pin  # pin: the staging buffer only (see HostProvider)
        self.codes = torch.empty(self.vocab_size, self.row_width, dtype=TORCH_DTYPES[table_dtype])
        self.scales = torch.ones(self.vocab_size, len(self.layers)) if table_dtype == "int8" else None
        for k, layer in enumerate(self.layers):
            offset, width = self.layer_slices[layer]
            source = sources[layer]
            for start in range(0, self.vocab_size, ROW_BLOCK):  # block by block: never a full-precision copy
                block = slice(start, min(start + ROW_BLOCK, self.vocab_size))
                dest = self.codes[block, offset : offset + width]
                if self.scales is None:
                    dest.copy_(source.rows(block, self.codes.dtype))
                    continue
                codes, scale = source.codes(block) if source.stored == "int8" else quantize_rows(source.rows(block))
                dest.copy_(codes)
                self.scales[block, k] = scale

    @classmethod
    def from_provider(
        cls, base: TableProvider, table_dtype: str, out_dtype: torch.dtype | None = None
    ) -> CompactProvider:
        """The rows of another provider (all of them, gathered block by block), stored as `table_dtype`."""
        check_table_dtype(table_dtype)
        every = base.gather(torch.arange(base.vocab_size)) if base.vocab_size <= ROW_BLOCK else None
        sources = {}
        for layer in base.layers:
            offset, width = base.layer_slices[layer]
            if every is not None:
                sources[layer] = every[:, offset : offset + width]
            else:
                sources[layer] = _ProviderColumns(base, offset, width)
        return cls(sources, table_dtype, out_dtype or base.dtype, base.pin)

    @property
    def stored_row_bytes(self) -> int:
        return self._stored_bytes(self.codes.element_size(), self.scales is not None)

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        codes = self.codes.index_select(0, ids)
        out = self._output(ids.numel())
        if self.scales is None:
            return out.copy_(codes)
        scales = self.scales.index_select(0, ids)
        for k, layer in enumerate(self.layers):
            offset, width = self.layer_slices[layer]
            out[:, offset : offset + width] = dequantize_rows(
                codes[:, offset : offset + width], scales[:, k], self.dtype
            )
        return out


class _ProviderColumns(RowSource):
    """One layer's columns of another provider, read block by block (`CompactProvider.from_provider`)."""

    def __init__(self, base: TableProvider, offset: int, width: int) -> None:
        self.base, self.offset, self.width = base, offset, width
        self.shape, self.scale, self.stored = (base.vocab_size, width), None, "fp32"

    def rows(self, index, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        ids = torch.arange(self.base.vocab_size)[index]
        return self.base.gather(ids)[:, self.offset : self.offset + self.width].to(dtype)


class CompactMmapProvider(_Compact):
    """Rows read on demand from a compact checkpoint's mapped files (int8 codes + scales, or bf16)."""

    def __init__(self, sources: dict[int, RowSource], out_dtype: torch.dtype | None = None, pin: bool = False) -> None:
        layers, widths, vocab = _layer_widths(sources)
        super().__init__(vocab, layers, widths, out_dtype or torch.float32)
        self.sources, self.pin = [sources[i] for i in self.layers], pin
        stored = {s.stored for s in self.sources}
        if len(stored) != 1:
            raise StemlmError(f"the table layers are stored in mixed formats ({', '.join(sorted(stored))})")
        self.table_dtype = stored.pop()

    @property
    def stored_row_bytes(self) -> int:
        return self._stored_bytes(TORCH_DTYPES[self.table_dtype].itemsize, self.table_dtype == "int8")

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        out = self._output(ids.numel())
        index = ids.numpy()
        for layer, source in zip(self.layers, self.sources, strict=True):
            offset, width = self.layer_slices[layer]
            out[:, offset : offset + width] = source.rows(index, self.dtype)
        return out
