"""stemlm's vLLM plugin: `vllm serve CKPT` and `vllm.LLM(model=CKPT)` load a stemlm checkpoint folder.

Installed with the `vllm` extra (`pip install 'stemlm[vllm]'`); vLLM finds `stemlm.vllm.plugin.register` through the
`vllm.general_plugins` entry point in pyproject.toml and calls it in every process it starts. Nothing else in
stemlm imports this package, so `import stemlm` never imports vLLM.

- `stemlm.vllm.plugin.register`: the config class for model_type "stemlm" (`stemlm.hf.StemlmConfig`, so vLLM
  reads config.json) and the architecture `StemlmForCausalLM` in vLLM's model registry, by its import path (vLLM
  imports it when a model asks for it).
- `stemlm.vllm.model`: the model in vLLM's layers; `stemlm.vllm.ffn` its FFN kinds (dense, STEM, n-gram STEM, Engram),
  `stemlm.vllm.history` the earlier positions the n-gram kinds read, `stemlm.vllm.kinds` why other kinds are refused.
- `stemlm.vllm.edits`: an ASGI middleware for `vllm serve --middleware` that refuses stemlm's per-request `edit`.

docs/vllm.md: install, the command, what maps onto vLLM and what does not, tables in host memory.
"""
