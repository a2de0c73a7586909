"""`StemlmConfig`: the Hugging Face `PreTrainedConfig` twin of `stemlm.model.config.ModelConfig` (model_type "stemlm").

It lets `AutoConfig.from_pretrained(folder)` read a stemlm checkpoint's config.json. The fields are the
`ModelConfig` fields with the same defaults (a test keeps the two in step), plus `router_aux_loss_coef`, which
only the HF wrapper uses: its `loss` is cross-entropy + `router_aux_loss_coef` · MoE auxiliary loss. All
validation is `ModelConfig`'s, so a config that stemlm rejects is rejected here with the same message.
Importing this module costs only `transformers.configuration_utils` (no torch model code); creating the first
instance registers the model class with `AutoModelForCausalLM` (see `stemlm.hf.autoregister`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from transformers.configuration_utils import PreTrainedConfig

from stemlm.model.config import MODEL_TYPE, ModelConfig

# Called with no arguments by every new StemlmConfig; `stemlm.hf.autoregister` adds its hook when this loads.
CREATED_HOOKS: list[Callable[[], None]] = []


class StemlmConfig(PreTrainedConfig):
    model_type = MODEL_TYPE

    # --- shared decoder fields (Hugging Face Llama names) ---
    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rope_llama3: dict | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    # --- FFN selection and token tables ---
    ffn: str = "stem"
    stem_layers: str | list[int] = "all-but-first"
    table_init: str = "xavier"
    table_init_std: float = 0.02
    # --- MoE / hash-MoE ---
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    moe_shared_expert: bool = False
    router_z_loss: bool = False
    hash_seed: int = 0
    # --- PLE ---
    ple_dim: int = 256
    # --- n-gram keyed STEM, Engram, product-key memory ---
    stem_ngram_orders: str = "2"
    stem_ngram_heads: int = 2
    stem_ngram_rows: int | None = None
    engram_orders: str = "2,3"
    engram_heads: int = 4
    engram_rows: int | None = None
    engram_dim: int = 256
    engram_kernel: int = 4
    memory_keys: int = 128
    memory_topk: int = 16
    memory_heads: int = 4
    memory_key_dim: int = 64
    # --- HF wrapper only (not part of ModelConfig) ---
    router_aux_loss_coef: float = 0.01  # Switch Transformers' alpha

    def __post_init__(self, **kwargs) -> None:
        super().__post_init__(**kwargs)
        self.to_model_config()  # validates: raises StemlmError (a ValueError) with ModelConfig's message
        for hook in CREATED_HOOKS:  # stemlm.hf.autoregister's: the first config registers StemlmForCausalLM
            hook()

    def to_model_config(self) -> ModelConfig:
        """The stemlm `ModelConfig` this HF config describes."""
        return ModelConfig.from_dict({name: getattr(self, name) for name in model_config_fields()})

    @classmethod
    def from_model_config(cls, config: ModelConfig, **kwargs) -> StemlmConfig:
        """An HF config from a stemlm `ModelConfig` (extra HF keyword arguments pass through)."""
        return cls(**{**config.to_dict(), **kwargs})


def model_config_fields() -> list[str]:
    """Names of the `ModelConfig` fields carried by `StemlmConfig` (all but `model_type`, a class attribute here)."""
    return [f.name for f in dataclasses.fields(ModelConfig) if f.name != "model_type"]
