"""vLLM's default `--dtype auto` serves a stemlm folder in the dtype the folder records, not in bfloat16.

vLLM 0.32 resolves `auto` in `vllm.config.model._resolve_auto_dtype(model_type, config_dtype, *, is_pooling_model)`:
it takes config.json's `torch_dtype` (or the weights' dtype) and replaces float32 with the platform's preferred
dtype (bfloat16 on a CPU with it, as on a GPU), whatever the model. stemlm trains and generates in float32, so that
default gives other greedy tokens than `stemlm generate --greedy` wherever two logits are nearly equal.

vLLM has no per-model setting for this: its per-architecture hook (`MODELS_CONFIG_MAP`'s
`verify_and_update_model_config`) runs after the dtype is resolved and cannot tell `auto` from an explicit
`--dtype bfloat16`. So the plugin wraps that one function, for model_type "stemlm" only: `auto` then keeps the
recorded dtype when the platform supports it and falls through to vLLM's rule otherwise (and for every other
model). An explicit `--dtype` never reaches the function, so it still chooses. tests/vllm/test_auto_dtype.py fails
when vLLM renames or reshapes the function, and `wrap_auto_dtype` logs a warning and changes nothing then (the
model's load then notes the cast, `stemlm.vllm.kinds.dtype_note`).
"""

from __future__ import annotations

import functools
import inspect
import logging

from stemlm.model.config import MODEL_TYPE

logger = logging.getLogger(__name__)  # stdlib, so the module imports (and the docs' name resolves) without vLLM

EXPECTED = ["model_type", "config_dtype", "is_pooling_model"]  # the parameters of the function wrapped


def keep_recorded(resolve):
    """`resolve` (vLLM's rule) with stemlm's: a stemlm config's dtype is kept where the platform supports it."""

    @functools.wraps(resolve)
    def resolve_auto_dtype(model_type, config_dtype, *args, **kwargs):
        from vllm.platforms import current_platform

        if model_type == MODEL_TYPE and config_dtype in current_platform.supported_dtypes:
            return config_dtype
        return resolve(model_type, config_dtype, *args, **kwargs)

    resolve_auto_dtype.stemlm_wraps = resolve
    return resolve_auto_dtype


def wrap_auto_dtype() -> bool:
    """Wrap vLLM's `_resolve_auto_dtype` once per process (the plugin hook runs more than once); False, with a
    warning, where this vLLM has no such function of the expected shape."""
    from vllm.config import model as vllm_model_config

    resolve = getattr(vllm_model_config, "_resolve_auto_dtype", None)
    if resolve is None or list(inspect.signature(resolve).parameters) != EXPECTED:
        logger.warning(
            "stemlm: this vLLM has no _resolve_auto_dtype(%s) in vllm.config.model, so --dtype auto serves stemlm "
            "folders in its own choice of dtype; pass --dtype float32 for `stemlm generate`'s tokens",
            ", ".join(EXPECTED),
        )
        return False
    if not hasattr(resolve, "stemlm_wraps"):
        vllm_model_config._resolve_auto_dtype = keep_recorded(resolve)
    return True
