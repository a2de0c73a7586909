"""Hugging Face integration, kept out of the core: nothing in `stemlm` outside this package imports transformers.

    from stemlm.hf import StemlmConfig, StemlmForCausalLM, StemlmModel, register

- `StemlmConfig` / `StemlmForCausalLM` (model_type "stemlm"): every FFN kind through `AutoConfig` /
  `AutoModelForCausalLM` and `generate()`. `import stemlm` registers them with the Auto classes as soon as
  transformers' auto modules are imported (see `stemlm.hf.autoregister`); `register()` does it explicitly.
  `StemlmModel` is the base model (`AutoModel`, `StemlmForCausalLM.model`): the decoder without its head.
- `StemlmForSequenceClassification`, `StemlmForTokenClassification`, `StemlmForQuestionAnswering` (`stemlm.hf.heads`):
  transformers' generic task heads on `StemlmModel`, through their Auto classes.
- A dense stemlm folder is also a Llama folder: `LlamaForCausalLM.from_pretrained(folder)` loads it unchanged
  (transformers logs that the model types differ, then loads every weight).
- A local HF Llama folder loads as a dense `StemLM` through `stemlm.from_pretrained` (safetensors only).

The submodules load lazily, so `import stemlm.hf` itself costs nothing until one of these names is used.
"""

from stemlm._lazy import lazy_exports

_EXPORTS = {
    "StemlmConfig": "stemlm.hf.configuration",
    "StemlmForCausalLM": "stemlm.hf.modeling",
    "StemlmModel": "stemlm.hf.modeling",
    "StemlmCausalLMOutput": "stemlm.hf.modeling",
    "StemlmForSequenceClassification": "stemlm.hf.heads",
    "StemlmForTokenClassification": "stemlm.hf.heads",
    "StemlmForQuestionAnswering": "stemlm.hf.heads",
    "register": "stemlm.hf.autoregister",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
