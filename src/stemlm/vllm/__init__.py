"""stemlm's vLLM plugin: `vllm serve CKPT` and `vllm.LLM(model=CKPT)` load a stemlm checkpoint folder.

Installed with the `vllm` extra (`pip install 'stemlm[vllm]'`); vLLM finds `register` through the
`vllm.general_plugins` entry point in pyproject.toml and calls it in every process it starts. Nothing else in
stemlm imports this package, so `import stemlm` never imports vLLM.

- `register`: the config class for model_type "stemlm" (`stemlm.hf.StemlmConfig`, so vLLM reads config.json) and
  the architecture `StemlmForCausalLM` in vLLM's model registry, by its import path (vLLM imports it when a model
  asks for it).
- `stemlm.vllm.model`: the model in vLLM's layers (dense and STEM; `stemlm.vllm.kinds` says why others are refused).
- `stemlm.vllm.edits`: an ASGI middleware for `vllm serve --middleware` that refuses stemlm's per-request `edit`.

docs/vllm.md: install, the command, what maps onto vLLM and what does not, tables in host memory.
"""

from __future__ import annotations

ARCHITECTURES = ("StemlmForCausalLM",)  # what config.json's "architectures" says (ModelConfig.to_hf_dict)


def register() -> None:
    """vLLM's general-plugin hook: safe to call more than once (vLLM calls it in each of its processes)."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from stemlm.hf.configuration import StemlmConfig
    from stemlm.model.config import MODEL_TYPE

    AutoConfig.register(MODEL_TYPE, StemlmConfig, exist_ok=True)
    for arch in ARCHITECTURES:
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, f"stemlm.vllm.model:{arch}")
