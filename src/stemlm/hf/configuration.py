"""`StemlmConfig`: the Hugging Face `PreTrainedConfig` twin of `stemlm.model.config.ModelConfig` (model_type "stemlm").

It lets `AutoConfig.from_pretrained(folder)` read a stemlm checkpoint's config.json. The fields are the `ModelConfig`
fields with the same defaults (read from it, so every kind's fields are there), plus what only the HF wrapper uses:
`router_aux_loss_coef` (its `loss` is cross-entropy + `router_aux_loss_coef` · MoE auxiliary loss), `use_cache` and
the special token ids `bos_token_id`, `eos_token_id`, `pad_token_id` (read by `generate()`). All validation is
`ModelConfig`'s, so a config that stemlm rejects is rejected here with the same message; transformers'
`rope_parameters` / `rope_scaling`, which the decoder does not read, are refused unless they say what `rope_theta`
already says.
Importing this module costs only `transformers.configuration_utils` (no torch model code); creating the first
instance registers the model class with `AutoModelForCausalLM` (see `stemlm.hf.autoregister`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from transformers.configuration_utils import PreTrainedConfig

from stemlm.errors import StemlmError
from stemlm.model.config import MODEL_TYPE, RENAMED_FIELDS, ModelConfig

# Called with no arguments by every new StemlmConfig; `stemlm.hf.autoregister` adds its hook when this loads.
CREATED_HOOKS: list[Callable[[], None]] = []


def _fields(namespace: dict) -> None:
    """Every `ModelConfig` field but `model_type` (a class attribute here), with its annotation and default."""
    annotations = namespace.setdefault("__annotations__", {})
    for f in dataclasses.fields(ModelConfig):
        if f.name != "model_type":
            annotations[f.name] = f.type
            namespace[f.name] = f.default


class StemlmConfig(PreTrainedConfig):
    model_type = MODEL_TYPE
    _fields(vars())  # the ModelConfig fields (shared and every kind's), never a hand copy
    # --- HF wrapper only (not part of ModelConfig) ---
    router_aux_loss_coef: float = 0.01  # Switch Transformers' alpha
    # Declared as LlamaConfig declares them, so `generate()` finds them; None where the folder does not say
    # (a stemlm checkpoint's config.json carries no tokenizer ids), as transformers' own defaults are.
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs) -> None:
        _take_renamed_fields(self, kwargs)
        super().__post_init__(**kwargs)
        _refuse_rope_scaling(self)
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


def _take_renamed_fields(config: StemlmConfig, kwargs: dict) -> None:
    """An old field name (`stemlm.model.config.RENAMED_FIELDS`: `StemlmConfig(stem_layers=...)`, a config.json
    written before the rename) sets the field; given beside the new name with another value it is refused. The
    new name counts as given when it differs from its default (a dataclass cannot tell otherwise)."""
    for old, new in RENAMED_FIELDS.items():
        if old not in kwargs:
            continue
        value, default = kwargs.pop(old), getattr(type(config), new)
        if getattr(config, new) != default and getattr(config, new) != value:
            raise StemlmError(
                f"config gives both {old}={value!r} and {new}={getattr(config, new)!r}; {old} is the old name of {new}"
            )
        setattr(config, new, value)


def _refuse_rope_scaling(config: StemlmConfig) -> None:
    """transformers' `rope_parameters` (or the older `rope_scaling`) are read by its own models only; stemlm's
    decoder takes `rope_theta` and `rope_llama3`, so any other RoPE setting would be silently ignored: refused."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", config.rope_theta)
    if rope_type != "default" or theta != config.rope_theta:
        raise StemlmError(
            f"rope_parameters {params!r}: stemlm models take RoPE settings only as rope_theta and rope_llama3 "
            "(Llama 3 scaling); linear, dynamic and other scaling types are not implemented"
        )


def model_config_fields() -> list[str]:
    """Names of the `ModelConfig` fields carried by `StemlmConfig` (all but `model_type`, a class attribute here)."""
    return [f.name for f in dataclasses.fields(ModelConfig) if f.name != "model_type"]
