"""The hook vLLM calls (the `vllm.general_plugins` entry point in pyproject.toml): stemlm's config class and
architecture in vLLM's registries, the model code named by its import path so vLLM imports it only on demand, and
`--dtype auto` kept at the dtype a stemlm folder records (stemlm.vllm.auto_dtype)."""

from __future__ import annotations

ARCHITECTURES = ("StemlmForCausalLM",)  # what config.json's "architectures" says (ModelConfig.to_hf_dict)


def register() -> None:
    """vLLM's general-plugin hook: safe to call more than once (vLLM calls it in each of its processes)."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from stemlm.hf.configuration import StemlmConfig
    from stemlm.model.config import MODEL_TYPE
    from stemlm.vllm.auto_dtype import wrap_auto_dtype

    AutoConfig.register(MODEL_TYPE, StemlmConfig, exist_ok=True)
    for arch in ARCHITECTURES:
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, f"stemlm.vllm.model:{arch}")
    wrap_auto_dtype()
