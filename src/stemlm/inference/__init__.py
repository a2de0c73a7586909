"""Running a model: one loader with a table placement, one decoding engine, chat prompts and offloaded tables.

Modules: `load` (`load_inference` + `InferenceOptions`: the loader of generate, serve, eval and cache-sim),
`inference_model` (`InferenceModel`: autocast, row source and compiled steps wrapped around a model), `rows` (the
row-source interface), `engine` (`Engine`: prefill, step and the one decoding loop), `requests` / `sampling`
(`Request`, `SamplingParams`: prompt checks, budget, stops, seeded sampling), `generate` (`generate` /
`stream_tokens` over the engine), `batching` (continuous batching on the engine), `chat` (a checkpoint's chat
template), `offloaded` (`OffloadedLM`: tables in host memory or memory-mapped). Names load lazily:

    from stemlm.inference import InferenceOptions, load_inference, generate
"""

from stemlm._lazy import lazy_exports

_EXPORTS = {
    "InferenceOptions": "stemlm.inference.load",
    "load_inference": "stemlm.inference.load",
    "InferenceModel": "stemlm.inference.inference_model",
    "Engine": "stemlm.inference.engine",
    "Request": "stemlm.inference.requests",
    "SamplingParams": "stemlm.inference.sampling",
    "generate": "stemlm.inference.generate",
    "stream_tokens": "stemlm.inference.generate",
    "BatchEngine": "stemlm.inference.batching",
    "OffloadedLM": "stemlm.inference.offloaded",
    "open_checkpoint": "stemlm.inference.offloaded",
    "forced_decode": "stemlm.inference.offloaded",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
