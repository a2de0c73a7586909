"""Which stemlm checkpoints the vLLM plugin serves, and why the others are refused (one line each, at load).

Served: every layer of a kind that declares no `vllm_unserved` reason (`stemlm.model.kinds.registry.Kind`: dense,
STEM, n-gram STEM and Engram), at the FFN position or beside it (Engram's `engram_layers`). Plain or Llama-3 RoPE,
tables stored in fp32 or bf16. The refusals name the reason the kind declares; docs/vllm.md has the same table.
This module imports no vLLM, so the reasons are testable where vLLM is not installed.
"""

from __future__ import annotations

from stemlm.model.config import ModelConfig
from stemlm.model.kinds.registry import all_kinds, get_kind


def served_kinds() -> tuple[str, ...]:
    """The kinds the plugin serves at the FFN position, in kind order."""
    return tuple(kind.name for kind in all_kinds() if kind.vllm_unserved is None)


def check_servable(hf_config) -> ModelConfig:
    """The stemlm `ModelConfig` of a loaded `StemlmConfig`, or ValueError saying why vLLM cannot serve it."""
    config = hf_config.to_model_config()
    served = ", ".join(served_kinds())
    for name in sorted({config.layer_ffn(i) for i in range(config.num_hidden_layers)}):
        reason = get_kind(name).vllm_unserved
        if reason is not None:
            raise ValueError(f"stemlm's vLLM plugin serves {served} layers; not {name}: {reason}")
    for name in sorted({side for i in range(config.num_hidden_layers) for side in config.layer_sides(i)}):
        reason = get_kind(name).vllm_unserved
        if reason is not None:
            field = get_kind(name).layers_field
            raise ValueError(f"stemlm's vLLM plugin serves {served} layers; not {name} ({field}): {reason}")
    storage = getattr(hf_config, "stemlm_table_storage", None)
    if storage and storage.get("dtype") == "int8":
        raise ValueError(
            "this checkpoint stores its tables as int8 rows with per-row scales, which vLLM's loader does not "
            "dequantise: write an fp32 or bf16 copy with `stemlm convert CKPT --table-dtype bf16 --out DIR`"
        )
    return config


def dtype_note(recorded, served) -> str | None:
    """What to say when vLLM runs a checkpoint in another precision than the one it records (config.json's
    `torch_dtype`, the dtype `stemlm generate` computes in), as an explicit `--dtype bfloat16` does (`auto` keeps
    the recorded one, stemlm.vllm.auto_dtype): bf16 can turn a greedy choice between near-equal logits the other way."""
    if recorded is None or served == recorded:
        return None
    name = str(recorded).removeprefix("torch.")
    return (
        f"stemlm: serving in {str(served).removeprefix('torch.')}, but the checkpoint computes in {name} "
        "(its weights' dtype, config.json torch_dtype): greedy tokens can differ from `stemlm generate`'s; "
        f"pass --dtype {name} (or leave --dtype out) for the same tokens"
    )


def rope_parameters(config: ModelConfig) -> dict:
    """vLLM's `get_rope` settings for stemlm's RoPE: plain, or Llama 3's scaling (the same four keys)."""
    if config.rope_llama3 is None:
        return {"rope_type": "default", "rope_theta": config.rope_theta}
    return {"rope_type": "llama3", "rope_theta": config.rope_theta, **config.rope_llama3}
