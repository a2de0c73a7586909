"""Which stemlm checkpoints the vLLM plugin serves, and why the others are refused (one line each, at load).

Served: every layer dense or STEM (`ffn` "dense" or "stem", no kind beside the FFN), plain or Llama-3 RoPE, tables
stored in fp32 or bf16. The refusals name the reason; docs/vllm.md has the same table.
This module imports no vLLM, so the table of reasons is testable where vLLM is not installed.
"""

from __future__ import annotations

from stemlm.model.config import ModelConfig

SERVED = ("dense", "stem")
# Kinds that fit vLLM's execution model (each token's output depends on its own id and hidden state, plus the KV
# cache) but have no vLLM module written here yet.
NOT_WRITTEN = {
    "stem_gate": "a token-indexed lookup like STEM's (the gate's rows instead of the up-projection's)",
    "stem_adapter": "STEM's lookup blended with a dense up-projection by a learned per-channel gate",
    "ple": "a narrow token-indexed table gated by the hidden state (vLLM's Gemma-3n does the same)",
    "value_embed": "token-indexed rows mixed into attention's values before the KV cache keeps them",
    "moe": "a routed mixture of experts (vLLM's FusedMoE with a softmax top-k router)",
    "hash_moe": "experts chosen by a fixed id -> expert map (FusedMoE with routing read from the input ids)",
    "memory": "product-key memory: a top-k over sub-keys and a weighted sum of value rows, per token",
}
# Kinds whose output at a position needs the ids (or branch values) of earlier positions: vLLM hands a model only
# the tokens of this step, so they need per-request state kept across steps, which vLLM keeps only inside its
# own DeepSeek Engram model (a slot cache beside the KV cache), not for a plugin.
NEEDS_HISTORY = {
    "stem_ngram": "its rows are keyed by hashed n-grams of the preceding ids, which a decode step does not see",
    "engram": "hashed n-grams of the preceding ids and a causal convolution over earlier positions' branch values",
}


def unsupported_reason(kind: str) -> str:
    if kind in NOT_WRITTEN:
        return f"{kind} maps onto vLLM ({NOT_WRITTEN[kind]}) but the plugin has no module for it yet"
    if kind in NEEDS_HISTORY:
        return f"{kind} does not map onto vLLM's step: {NEEDS_HISTORY[kind]}"
    return f"{kind} is not a kind this plugin knows"


def check_servable(hf_config) -> ModelConfig:
    """The stemlm `ModelConfig` of a loaded `StemlmConfig`, or ValueError saying why vLLM cannot serve it."""
    config = hf_config.to_model_config()
    kinds = {config.layer_ffn(i) for i in range(config.num_hidden_layers)}
    kinds |= {side for i in range(config.num_hidden_layers) for side in config.layer_sides(i)}
    for kind in sorted(kinds - set(SERVED)):
        raise ValueError(f"stemlm's vLLM plugin serves dense and STEM layers only: {unsupported_reason(kind)}")
    storage = getattr(hf_config, "stemlm_table_storage", None)
    if storage and storage.get("dtype") == "int8":
        raise ValueError(
            "this checkpoint stores its tables as int8 rows with per-row scales, which vLLM's loader does not "
            "dequantise: write an fp32 or bf16 copy with `stemlm convert CKPT --table-dtype bf16 --out DIR`"
        )
    return config


def rope_parameters(config: ModelConfig) -> dict:
    """vLLM's `get_rope` settings for stemlm's RoPE: plain, or Llama 3's scaling (the same four keys)."""
    if config.rope_llama3 is None:
        return {"rope_type": "default", "rope_theta": config.rope_theta}
    return {"rope_type": "llama3", "rope_theta": config.rope_theta, **config.rope_llama3}
