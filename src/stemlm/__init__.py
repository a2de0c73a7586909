"""stemlm: STEM transformers (Scaling Transformers with Embedding Modules, arXiv 2601.10639).

The public API is loaded lazily so that `import stemlm` stays fast and free of side effects beyond
registering the Hugging Face Auto classes when transformers is imported by the user:

    from stemlm import ModelConfig, build_model, from_pretrained
"""

from stemlm._lazy import lazy_exports
from stemlm.hf.autoregister import install as _install_hf_autoregister

__version__ = "0.1.0"

_EXPORTS = {
    "ModelConfig": "stemlm.model.config",
    "StemlmError": "stemlm.errors",
    "build_model": "stemlm.model.decoder",
    "StemLM": "stemlm.model.decoder",
    "from_pretrained": "stemlm.checkpoint.runs",
    "save_pretrained": "stemlm.checkpoint.folder",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)


# AutoConfig / AutoModelForCausalLM learn model_type "stemlm" when transformers' auto modules load (cheap until then).
_install_hf_autoregister()
