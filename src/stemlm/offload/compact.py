"""Compact table rows for inference: bf16, or int8 with one scale per row and table layer (row-wise int8).

    provider = CompactProvider(HostProvider(...), "int8")     # same `gather(ids)` interface, fewer bytes
    codes, scale = quantize_rows(rows)                          # rows [N, w] -> int8 [N, w], fp32 [N]

int8 is symmetric per row: scale = max|row| / 127, code = round(row / scale) in [-127, 127], and a row is
read back as code x scale (FBGEMM's row-wise 8-bit quantisation keeps a scale and a bias per row; one scale
suffices for the zero-centred STEM rows and keeps 0 exact). A token's row of every table layer is quantised
per layer, so one layer's large entries do not coarsen another's. `CompactProvider` stores the codes (and
scales) in host memory and dequantises the gathered rows on the host into `out_dtype`, so the cache, the
prefetcher and the model see ordinary rows. `stored_row_bytes` is what one token's rows occupy in the store
(what a decode step reads there per token missing from the cache): W x 4 (fp32), W x 2 (bf16),
W + 4 x layers (int8). Measured effect on held-out perplexity: `benchmarks/table_dtype.py`.
"""

from __future__ import annotations

import torch

from stemlm.errors import StemlmError
from stemlm.offload.providers import ROW_BLOCK, TableProvider

TABLE_DTYPES = ("fp32", "bf16", "int8")


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes [N, w] and fp32 scales [N] of `rows` [N, w]."""
    rows = rows.float()
    scale = rows.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: any scale reads back zeros
    codes = torch.round(rows / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (codes.float() * scale[:, None]).to(dtype)


class CompactProvider(TableProvider):
    """A provider whose rows are stored as bf16 or row-wise int8 and served dequantised in `out_dtype`."""

    kind = "host"

    def __init__(self, base: TableProvider, table_dtype: str, out_dtype: torch.dtype | None = None) -> None:
        if table_dtype not in TABLE_DTYPES:
            raise StemlmError(f"unknown table dtype {table_dtype!r}; choose one of {', '.join(TABLE_DTYPES)}")
        super().__init__(base.vocab_size, list(base.layers), list(base.widths), out_dtype or torch.float32)
        self.table_dtype, self.pin = table_dtype, base.pin
        stored = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}[table_dtype]
        self.codes = torch.empty(self.vocab_size, self.row_width, dtype=stored)
        self.scales = torch.ones(self.vocab_size, len(self.layers)) if table_dtype == "int8" else None
        for start in range(0, self.vocab_size, ROW_BLOCK):  # block by block: never a second full-precision copy
            ids = torch.arange(start, min(start + ROW_BLOCK, self.vocab_size))
            rows = base.gather(ids).float()
            if self.scales is None:
                self.codes[ids] = rows.to(stored)
                continue
            for k, layer in enumerate(self.layers):
                offset, width = self.layer_slices[layer]
                codes, scale = quantize_rows(rows[:, offset : offset + width])
                self.codes[ids, offset : offset + width] = codes
                self.scales[ids, k] = scale

    @property
    def stored_row_bytes(self) -> int:
        scales = 4 * len(self.layers) if self.scales is not None else 0
        return self.row_width * self.codes.element_size() + scales

    @property
    def host_bytes(self) -> int:
        return self.vocab_size * self.stored_row_bytes

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        codes = self.codes.index_select(0, ids)
        if self.scales is None:
            return codes.to(self.dtype)
        out = self._output(ids.numel())
        scales = self.scales.index_select(0, ids)
        for k, layer in enumerate(self.layers):
            offset, width = self.layer_slices[layer]
            part = codes[:, offset : offset + width]
            out[:, offset : offset + width] = dequantize_rows(part, scales[:, k], self.dtype)
        return out
