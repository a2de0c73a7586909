"""Hugging Face Llama folders: read one into a dense `StemLM`, or write a dense `StemLM` as one, without transformers.

    from stemlm.hf import load_hf_llama
    model = load_hf_llama("path/to/llama-folder")        # dense StemLM with the Llama's logits
    save_as_llama(dense_model, "out/llama", tokenizer)    # model_type "llama": LlamaForCausalLM loads it silently

Our weight names are HF Llama's, so the tensors load as they are; only the config is translated. Features
our decoder does not have are refused with a message instead of loading into a model with other logits:
RoPE scaling other than Llama 3's ("llama3" rope type, supported), attention or MLP biases, activations other than SiLU.
Weights are read from safetensors only: a folder with just `pytorch_model.bin` is refused (never unpickled).
Plain JSON parsing keeps this independent of transformers, so it costs no transformers import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from stemlm.checkpoint import CONFIG_NAME, WEIGHTS_NAME, read_json_object, read_state
from stemlm.config import ModelConfig
from stemlm.errors import StemlmError
from stemlm.model.decoder import StemLM
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


def _read_llama_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise StemlmError(f"{folder} has no {CONFIG_NAME}: not a Hugging Face model folder")
    return read_json_object(path)


def load_hf_llama(
    folder: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> StemLM:
    """A dense `StemLM` holding the weights of the HF Llama checkpoint in `folder` (local path)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise StemlmError(f"Llama folder {folder} does not exist")
    config = llama_config_to_model_config(_read_llama_config(folder))
    if not any(folder.glob("*.safetensors")) and any(folder.glob("pytorch_model*.bin")):
        raise StemlmError(
            f"{folder} holds only pickle weights (pytorch_model*.bin), which stemlm never loads; "
            f"re-save the model with safetensors ({WEIGHTS_NAME})"
        )
    state = read_state(folder, device)
    # Old checkpoints stored each layer's RoPE frequencies; ours are recomputed from rope_theta.
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = StemLM(config)
    expected = {
        k: v for k, v in model.state_dict().items() if not (config.tie_word_embeddings and k == "lm_head.weight")
    }
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        detail = "; ".join(
            f"{label} {len(names)} tensors (e.g. {names[0]})"
            for label, names in (("missing", missing), ("unexpected", unexpected))
            if names
        )
        raise StemlmError(f"{folder} is not a plain Llama checkpoint matching its config.json: {detail}")
    for name, ref in expected.items():
        if tuple(state[name].shape) != tuple(ref.shape):
            shape = list(state[name].shape)
            raise StemlmError(f"{folder}: tensor {name} has shape {shape}, config.json implies {list(ref.shape)}")
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.reset_buffers(device)
    return model


def model_config_to_llama_config(config: ModelConfig) -> dict[str, Any]:
    """The HF `LlamaConfig` dict of a dense model (every layer dense SwiGLU); anything else is refused."""
    if config.special_layers:
        raise StemlmError(
            f"only a dense model exports as Llama; this one has ffn {config.ffn!r} in layers {config.special_layers}"
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_size,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "initializer_range": config.initializer_range,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


LLAMA_PRODUCER = "stemlm convert --to-llama"


def save_as_llama(model: StemLM, directory: str | Path, tokenizer=None, *, force: bool = False, sources=()) -> Path:
    """Write a dense model as a Hugging Face Llama folder (config.json with model_type "llama", the same tensors
    under the same names, the tokenizer), atomically; `LlamaForCausalLM.from_pretrained` then loads it without
    a warning and with the same logits."""
    from safetensors.torch import save_file

    from stemlm.checkpoint import TOKENIZER_NAME, model_state_for_saving, write_json
    from stemlm.safe_write import AtomicFolder

    config = model_config_to_llama_config(model.config)
    with AtomicFolder(directory, producer=LLAMA_PRODUCER, force=force, sources=sources) as tmp:
        write_json(tmp / CONFIG_NAME, config)
        save_file(model_state_for_saving(model), str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save(str(tmp / TOKENIZER_NAME))
    return Path(directory)
