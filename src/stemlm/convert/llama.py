"""Writing a dense model as a Hugging Face Llama folder (`stemlm convert --to-llama`: `export_llama`), and the
files that let transformers load any model folder without stemlm (`stemlm export --remote-code`: `standalone_files`).

The tensors keep their names (ours are HF Llama's); only config.json changes, to model_type "llama", so
`LlamaForCausalLM.from_pretrained` loads the folder without a warning and with the same logits. Anything but a
dense model is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stemlm.checkpoint.folder import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    model_state_for_saving,
    write_json,
    write_tokenizer_files,
)
from stemlm.checkpoint.safe_write import AtomicFolder
from stemlm.errors import StemlmError
from stemlm.model.config import ModelConfig
from stemlm.model.decoder import StemLM


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

    config = with_token_ids(model_config_to_llama_config(model.config), tokenizer)
    with AtomicFolder(directory, producer=LLAMA_PRODUCER, force=force, sources=sources) as tmp:
        write_json(tmp / CONFIG_NAME, config)
        save_file(model_state_for_saving(model), str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        if tokenizer is not None:
            write_tokenizer_files(tokenizer, tmp, model.config.max_position_embeddings)
    return Path(directory)


def with_token_ids(config: dict[str, Any], tokenizer) -> dict[str, Any]:
    """A Llama config.json naming the special token ids the folder's tokenizer files name (end-of-text as eos, no
    bos): `LlamaConfig`'s own defaults (bos 1, eos 2) would stand otherwise. Unchanged without a tokenizer."""
    if tokenizer is None:
        return config
    from stemlm.data.tokenizer import EOT_TOKEN

    return {**config, "bos_token_id": None, "eos_token_id": tokenizer.token_to_id(EOT_TOKEN)}


def standalone_files(folder: Path, model: StemLM, tokenizer=None) -> None:
    """Make a model folder loadable by transformers without stemlm (`stemlm export --remote-code`): a dense model
    becomes a Llama folder (config.json with model_type "llama"), any other kind gets the generated modeling code
    (`stemlm.hf.remote_code`); both with the tokenizer's end-of-text id as `eos_token_id` (`generate()` stops there)."""
    from stemlm.data.tokenizer import EOT_TOKEN
    from stemlm.hf.remote_code import add_remote_code

    eos = None if tokenizer is None else tokenizer.token_to_id(EOT_TOKEN)
    if model.config.special_layers:
        add_remote_code(folder, eos_token_id=eos)
        return
    write_json(folder / CONFIG_NAME, with_token_ids(model_config_to_llama_config(model.config), tokenizer))


def export_llama(ckpt: str | Path, out: str | Path, *, force: bool = False) -> Path:
    """`stemlm convert --to-llama`: a dense checkpoint or run folder written as a Llama folder at `out`, the
    target checked (never the source, only an earlier export with `force`) before anything is loaded."""
    from stemlm.checkpoint.runs import load_checkpoint, resolve_checkpoint
    from stemlm.checkpoint.safe_write import check_target

    sources = (ckpt, resolve_checkpoint(ckpt))
    check_target(out, producer=LLAMA_PRODUCER, force=force, sources=sources)
    model, tokenizer = load_checkpoint(ckpt)
    return save_as_llama(model, out, tokenizer, force=force, sources=sources)
