"""Reading a Hugging Face Llama folder: its config.json translated into a dense `ModelConfig`.

Our weight names are HF Llama's, so a Llama folder's tensors load as they are (`stemlm.checkpoint.runs.
from_pretrained` reads both kinds of folder); only the config is translated here. Features our decoder does
not have are refused with a message instead of loading into a model with other logits: RoPE scaling other
than Llama 3's ("llama3" rope type, supported), attention or MLP biases, activations other than SiLU. Plain
JSON parsing keeps this independent of transformers, so it costs no transformers import.
"""

from __future__ import annotations

from typing import Any

from stemlm.errors import StemlmError
from stemlm.model.config import ModelConfig
from stemlm.model.rope_scaling import LLAMA3_KEYS

LLAMA_MODEL_TYPES = ("llama",)
# LlamaConfig defaults for the fields an older or hand-written config.json may omit.
LLAMA_DEFAULTS = {
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "initializer_range": 0.02,
}


def _rope(data: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, llama3 scaling dict or None); other RoPE scaling types are refused."""
    # transformers 5 writes {"rope_parameters": {"rope_type", "rope_theta", ...}}; older versions a top-level
    # rope_theta plus an optional rope_scaling dict.
    params = data.get("rope_parameters") or data.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise StemlmError(f"unreadable rope parameters {params!r} in the Llama config")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise StemlmError(
            f"the Llama config uses RoPE scaling of type {rope_type!r}, which stemlm's decoder does not implement; "
            "only plain RoPE ('default') and Llama 3's ('llama3') checkpoints can be loaded"
        )
    theta = float(params.get("rope_theta", data.get("rope_theta", LLAMA_DEFAULTS["rope_theta"])))
    if rope_type == "default":
        return theta, None
    return theta, {k: params[k] for k in LLAMA3_KEYS if k in params}


def llama_config_to_model_config(data: dict[str, Any]) -> ModelConfig:
    """The dense `ModelConfig` equivalent to an HF Llama config.json dict (refusing what we cannot represent)."""
    if data.get("model_type") not in LLAMA_MODEL_TYPES:
        raise StemlmError(f"config.json has model_type {data.get('model_type')!r}, not 'llama'")
    missing = [
        k
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        if k not in data
    ]
    if missing:
        raise StemlmError(f"the Llama config.json lacks {', '.join(missing)}")
    if data.get("hidden_act", "silu") != "silu":
        raise StemlmError(f"the Llama config uses hidden_act {data['hidden_act']!r}; stemlm's SwiGLU needs 'silu'")
    for flag in ("attention_bias", "mlp_bias"):
        if data.get(flag):
            raise StemlmError(f"the Llama config sets {flag}=true; stemlm's projections have no biases")
    theta, llama3 = _rope(data)
    return ModelConfig(
        vocab_size=data["vocab_size"],
        hidden_size=data["hidden_size"],
        intermediate_size=data["intermediate_size"],
        num_hidden_layers=data["num_hidden_layers"],
        num_attention_heads=data["num_attention_heads"],
        num_key_value_heads=data.get("num_key_value_heads"),
        head_dim=data.get("head_dim"),
        max_position_embeddings=data.get("max_position_embeddings", LLAMA_DEFAULTS["max_position_embeddings"]),
        rope_theta=theta,
        rope_llama3=llama3,
        rms_norm_eps=data.get("rms_norm_eps", LLAMA_DEFAULTS["rms_norm_eps"]),
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        initializer_range=data.get("initializer_range", LLAMA_DEFAULTS["initializer_range"]),
        ffn="dense",
    )


def is_llama_config(data: dict[str, Any]) -> bool:
    return data.get("model_type") in LLAMA_MODEL_TYPES
