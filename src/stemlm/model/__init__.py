"""The model layer: `config` (ModelConfig) and `presets`, the shared decoder parts (`attention`, `loss`,
`rope_scaling`), the per-layer kinds (`kinds/`: one module each, found by `kinds.registry`) and the blocks they
share (`ffn`, `experts`, `ngram`, `ngram_layout`), the decoder (`decoder`) and exact parameter/FLOP/byte
counting (`accounting`). Names load lazily:

    from stemlm.model import ModelConfig, build_model
"""

from stemlm._lazy import lazy_exports

_EXPORTS = {
    "ModelConfig": "stemlm.model.config",
    "get_preset": "stemlm.model.presets",
    "ModelOutput": "stemlm.model.decoder",
    "StemLM": "stemlm.model.decoder",
    "build_model": "stemlm.model.decoder",
    "check_token_ids": "stemlm.model.decoder",
    "TokenContext": "stemlm.model.ffn",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
