"""Inference with STEM tables outside accelerator memory: providers, a hot-row device cache and prefetch.

providers  where the tables live: resident, host (pinned, token- or layer-major), mmap (safetensors)
cache      LFU / LRU policy over token ids and the device storage of hot token-major rows
prefetch   the `table_rows` hook that fetches each step's rows on a background worker
engine     checkpoint loading without device tables, chunked prefill, decoding, `OffloadedLM`
"""

from stemlm.offload.cache import POLICIES, CachePolicy, CacheStats, RowCache, resolve_capacity
from stemlm.offload.engine import (
    OffloadedLM,
    decode_step,
    forced_decode,
    open_checkpoint,
    prefill,
    stream_generate,
)
from stemlm.offload.prefetch import RowPipeline
from stemlm.offload.providers import (
    TABLE_MODES,
    HostProvider,
    MmapProvider,
    ResidentProvider,
    TableProvider,
    device_parameter_bytes,
    load_model,
)

__all__ = [
    "POLICIES",
    "TABLE_MODES",
    "CachePolicy",
    "CacheStats",
    "HostProvider",
    "MmapProvider",
    "OffloadedLM",
    "ResidentProvider",
    "RowCache",
    "RowPipeline",
    "TableProvider",
    "decode_step",
    "device_parameter_bytes",
    "forced_decode",
    "load_model",
    "open_checkpoint",
    "prefill",
    "resolve_capacity",
    "stream_generate",
]
