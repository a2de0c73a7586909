"""Tables outside accelerator memory: where rows live, a hot-row device cache, and prefetch.

Modules: `providers` (resident, host (pinned, token- or layer-major), mmap (safetensors)), `compact` (int8/bf16
row storage), `cache` (LFU / LRU over token ids), `prefetch` (the row hook that fetches each step's rows on a
background worker), `families` (a checkpoint's lookup tables grouped by family; `stemlm.placement.load` opens them),
`lookup_rows` (the row source the decoding engine announces each forward's ids to, and the rows mapping the
model's forward takes). Decoding with them is `stemlm.inference.offloaded`.
Names load lazily:

    from stemlm.offload import HostProvider, RowCache, RowPipeline
"""

from stemlm._lazy import lazy_exports

_EXPORTS = {
    "CachePolicy": "stemlm.offload.cache",
    "CacheStats": "stemlm.offload.cache",
    "RowCache": "stemlm.offload.cache",
    "resolve_capacity": "stemlm.offload.cache",
    "RowPipeline": "stemlm.offload.prefetch",
    "HostProvider": "stemlm.offload.providers",
    "MmapProvider": "stemlm.offload.providers",
    "ResidentProvider": "stemlm.offload.providers",
    "TableProvider": "stemlm.offload.providers",
    "device_parameter_bytes": "stemlm.offload.providers",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
