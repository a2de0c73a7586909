"""The mmap placement (`--tables mmap`, inference only): the tables stay in the checkpoint's files, memory-mapped,
and a decode step reads the rows it misses in the device cache from the OS page cache (tables larger than RAM
are fine). Training cannot use it: a step updates its rows in place. The rows are read in the format the file
stores (fp32, or bf16 / int8 written by `stemlm convert --table-dtype`); asking for another is refused rather
than converted on every read. Tests: tests/offload/test_offload_providers.py, tests/offload/test_compact.py.
"""

from __future__ import annotations

import torch

from stemlm.errors import StemlmError
from stemlm.offload.compact import CompactMmapProvider
from stemlm.offload.providers import MmapProvider, TableProvider
from stemlm.placement.base import INFERENCE, Placement, StoredTables


class MmapTables(Placement):
    """Rows read on demand from the memory-mapped checkpoint (`stemlm.offload.providers.MmapProvider`)."""

    name = "mmap"
    tables = "mmap"
    purposes = frozenset({INFERENCE})
    where = "memory-mapped"
    offloaded = True

    @classmethod
    def check_row_format(cls, stored: str, want: str) -> None:
        if want != stored:
            raise StemlmError(
                f"--tables mmap reads the rows in the format the checkpoint stores ({stored}); to map {want} rows, "
                f"store them so first: stemlm convert CKPT --table-dtype {want} --out DIR (or use --tables host)"
            )

    @classmethod
    def provider(cls, stored: StoredTables) -> TableProvider:
        if stored.plain:
            return MmapProvider(stored.entries, dtype=stored.dtype, pin=stored.pin)
        return CompactMmapProvider(stored.sources, out_dtype=stored.dtype or torch.float32, pin=stored.pin)

    @classmethod
    def byte_counts(cls, table_bytes: int) -> dict[str, int]:
        return {"host_table_bytes": 0, "mapped_table_bytes": table_bytes}
