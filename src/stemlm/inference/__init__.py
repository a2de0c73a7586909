"""Running a model: one loader with a table placement, sampling, chat prompts and offloaded decoding.

Modules: `load` (`load_inference` + `InferenceOptions`: the loader of generate, serve, eval and cache-sim),
`generate` (sampling and the KV-cache decode loop), `chat` (a checkpoint's chat template), `offloaded`
(`OffloadedLM`: chunked prefill and decoding with tables in host memory or memory-mapped). Names load lazily:

    from stemlm.inference import InferenceOptions, load_inference, generate
"""

from stemlm._lazy import lazy_exports

_EXPORTS = {
    "InferenceOptions": "stemlm.inference.load",
    "load_inference": "stemlm.inference.load",
    "generate": "stemlm.inference.generate",
    "OffloadedLM": "stemlm.inference.offloaded",
    "open_checkpoint": "stemlm.inference.offloaded",
    "stream_generate": "stemlm.inference.offloaded",
    "forced_decode": "stemlm.inference.offloaded",
    "prefill": "stemlm.inference.offloaded",
    "decode_step": "stemlm.inference.offloaded",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
