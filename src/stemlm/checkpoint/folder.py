"""The model checkpoint format: a Hugging Face style folder, written atomically, read without pickle.

    config.json                      ModelConfig with HF Llama field names (model_type "stemlm")
    model.safetensors                all tensors, HF Llama names; STEM tables at
                                     model.layers.{i}.mlp.stem_embedding.weight
    model-0000k-of-0000n.safetensors + model.safetensors.index.json when larger than `max_shard_bytes`
    tokenizer.json                   optional: the HF tokenizer the model was trained with, and beside it
    tokenizer_config.json            its special tokens and the model's input names, for transformers'
    special_tokens_map.json          AutoTokenizer and what reads through it (pipelines, lm-eval, vLLM)

    stemlm-manifest.json             SHA-256 of every file, written at save (`stemlm verify CKPT` checks them)

A tied lm_head is saved once (as model.embed_tokens.weight) and re-tied on load. Every write goes through
`stemlm.checkpoint.safe_write.AtomicFolder`: a temporary sibling folder, fsynced and renamed into place, so an
interrupted save never damages the previous checkpoint, and an existing folder is never replaced unless
asked (`force`) and it is an earlier output of the same command. Loading a folder into a
model is `stemlm.checkpoint.runs.from_pretrained` (this module knows the format, not the model class, so
`stemlm.model` can import it to save itself without a cycle).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from stemlm.checkpoint.llama import is_llama_config, llama_config_to_model_config
from stemlm.checkpoint.names import (  # noqa: F401
    CONFIG_NAME,
    EOS_TOKEN,
    INDEX_NAME,
    SPECIAL_TOKENS_MAP_NAME,
    TOKENIZER_CONFIG_NAME,
    TOKENIZER_NAME,
    WEIGHTS_NAME,
)
from stemlm.checkpoint.safe_write import AtomicFolder, fsync_tree  # noqa: F401  (re-exported: the writers' import path)
from stemlm.checkpoint.sharded import is_sharded, read_sharded_state
from stemlm.checkpoint.table_storage import expand_state, read_storage
from stemlm.errors import StemlmError
from stemlm.model.config import MODEL_TYPE, ModelConfig
from stemlm.paths import input_file

if TYPE_CHECKING:  # the model imports this module to save itself; the format never needs the model class
    from stemlm.model.decoder import StemLM

DEFAULT_MAX_SHARD_BYTES = 4 * 1024**3
EMBED_NAME = "model.embed_tokens.weight"  # every model has it; its dtype is the weights' (tables may be stored apart)


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------------------------------------
# save
# ----------------------------------------------------------------------------------------------------------
def model_state_for_saving(model: StemLM) -> dict[str, torch.Tensor]:
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # stored once, as model.embed_tokens.weight
    return state


def _shards(state: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def write_model_files(
    model: StemLM, folder: Path, tokenizer=None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> None:
    """Write config, weights (sharded when large) and tokenizer into an existing folder (not atomic by itself)."""
    state = model_state_for_saving(model)
    write_model_config(model.config, folder, tokenizer, state[EMBED_NAME].dtype)
    shards = _shards(state, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    else:
        weight_map, total = {}, 0
        for k, shard in enumerate(shards, start=1):
            name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(folder / name), metadata={"format": "pt"})
            for tensor_name, t in shard.items():
                weight_map[tensor_name] = name
                total += t.numel() * t.element_size()
        write_json(folder / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})


def write_model_config(config: ModelConfig, folder: Path, tokenizer=None, dtype: torch.dtype = torch.float32) -> None:
    """config.json (and tokenizer.json) of a model folder; the weights are written by the caller. `dtype` is the
    one the model computes in (its weights'; stemlm trains and generates in fp32), recorded as `torch_dtype` for
    the readers that pick a precision from the folder (transformers, vLLM: docs/vllm.md)."""
    if tokenizer is not None and tokenizer.get_vocab_size() > config.vocab_size:
        raise StemlmError(
            f"tokenizer has {tokenizer.get_vocab_size()} tokens but the model's vocab_size is {config.vocab_size}"
        )
    write_json(folder / CONFIG_NAME, {**config.to_hf_dict(), "torch_dtype": str(dtype).removeprefix("torch.")})
    if tokenizer is not None:
        write_tokenizer_files(tokenizer, folder, config.max_position_embeddings)


def special_tokens(tokenizer) -> dict[str, str]:
    """The tokenizer's special tokens as transformers names them: `<|endoftext|>` is the end of sequence, the id
    `stemlm generate` stops on and the `eos_token_id` of the folder's Hugging Face config (`stemlm.hf`). stemlm
    prepends no beginning-of-sequence token and pads with none, so neither is named (as config.json names none)."""
    return {"eos_token": EOS_TOKEN} if tokenizer.token_to_id(EOS_TOKEN) is not None else {}


def write_tokenizer_files(tokenizer, folder: Path, max_length: int) -> None:
    """tokenizer.json and the two files transformers reads beside it: tokenizer_config.json (the tokenizer class,
    special tokens, the inputs the model takes, the longest input) and special_tokens_map.json. Without them
    `AutoTokenizer` gives a tokenizer with no eos, which generation pipelines and lm-eval's HF backend need."""
    tokenizer.save(str(folder / TOKENIZER_NAME))
    special = special_tokens(tokenizer)
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # tokenizer.json alone (transformers 5: TokenizersBackend)
        "model_input_names": ["input_ids", "attention_mask"],  # no token_type_ids: the model takes none
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,  # decode as stemlm does: byte-level BPE round-trips the text exactly
    }
    write_json(folder / TOKENIZER_CONFIG_NAME, {**settings, **special})
    write_json(folder / SPECIAL_TOKENS_MAP_NAME, special)


def save_pretrained(
    model: StemLM,
    directory: str | Path,
    tokenizer=None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    *,
    force: bool = False,
    sources: tuple = (),
    producer: str = "stemlm save_pretrained",
    extra=None,
) -> Path:
    """Save `model` (and optionally its `tokenizers.Tokenizer`) as an HF-style folder, atomically.

    An existing non-empty `directory` is refused unless `force` and it was written by the same `producer`
    (see `stemlm.checkpoint.safe_write.check_target`); `sources` are folders the result must never replace.
    `extra(folder, model, tokenizer)`, when given, adds files to the folder before it is moved into place
    (`stemlm export --remote-code` adds the modeling code there).
    """
    with AtomicFolder(directory, producer=producer, force=force, sources=sources) as tmp:
        write_model_files(model, tmp, tokenizer, max_shard_bytes)
        if extra is not None:
            extra(tmp, model, tokenizer)
    return Path(directory)


# ----------------------------------------------------------------------------------------------------------
# load
# ----------------------------------------------------------------------------------------------------------
def read_json_object(path: Path) -> dict:
    """A JSON file that must hold one object (config.json and the like), with one-line errors."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StemlmError(f"{path} is not valid JSON ({exc})") from None
    except RecursionError:
        raise StemlmError(f"{path} is not valid JSON (nested too deeply)") from None
    except ValueError as exc:  # an integer of more digits than Python converts (4300)
        raise StemlmError(f"{path} is not valid JSON ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise StemlmError(f"{path} does not hold a JSON object")
    return data


def load_config(directory: str | Path) -> ModelConfig:
    directory = Path(directory)
    if not directory.is_dir():
        old = directory.with_name(f".{directory.name}.old")
        hint = f" (a save was interrupted while swapping folders: rename {old} back to it)" if old.is_dir() else ""
        raise StemlmError(f"checkpoint folder {directory} does not exist{hint}")
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise StemlmError(f"{directory} has no {CONFIG_NAME}: not a stemlm checkpoint folder")
    data = read_json_object(path)
    if is_llama_config(data):  # a Hugging Face Llama folder (e.g. from `stemlm convert --from-gguf`): dense
        return llama_config_to_model_config(data)
    if data.get("model_type") != MODEL_TYPE:
        raise StemlmError(f"{path} is for model type {data.get('model_type')!r}, not {MODEL_TYPE!r} or 'llama'")
    try:
        return ModelConfig.from_dict(data)
    except StemlmError as exc:
        raise StemlmError(f"{path}: {exc}") from None


def weight_files(directory: str | Path) -> list[Path]:
    directory = Path(directory)
    if is_sharded(directory):
        raise StemlmError(
            f"{directory} is a sharded checkpoint (written by stemlm train --nproc); this reader needs the model "
            f"folder: convert it with stemlm export {directory} --out DIR"
        )
    if (directory / INDEX_NAME).is_file():
        try:
            index = json.loads((directory / INDEX_NAME).read_text())
            names = sorted(set(index["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
            raise StemlmError(f"{directory / INDEX_NAME} is corrupt") from None
        for name in names:
            # A shard is a file of this folder, named without any path: "../x" or "/etc/x" would read elsewhere.
            if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
                raise StemlmError(
                    f"{directory / INDEX_NAME} names weights file {name!r}, which is not a file of {directory}"
                )
        files = [directory / n for n in names]
    else:
        files = [directory / WEIGHTS_NAME]
    for f in files:
        if not f.exists():
            raise StemlmError(f"checkpoint {directory} is missing its weights file {f.name}")
        input_file(f, "weights file")  # a FIFO or a device named like a shard is never opened
    return files


def read_state(directory: str | Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder (safetensors only; never pickle); a sharded one is assembled, and
    compact tables (bf16 / int8 rows, `stemlm.checkpoint.table_storage`) come back dequantised to fp32."""
    if is_sharded(directory):
        return {k: v.to(device) for k, v in read_sharded_state(directory).items()}
    state: dict[str, torch.Tensor] = {}
    for f in weight_files(directory):
        try:
            with safe_open(str(f), framework="pt", device=str(device)) as reader:
                for name in reader.keys():
                    state[name] = reader.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as exc:
            raise StemlmError(f"weights file {f} is corrupt or truncated ({exc})") from None
    return expand_state(state, read_storage(directory), directory)


def write_weights(
    folder: Path, state: dict[str, torch.Tensor], max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, metadata=None
) -> None:
    """Write `state` as model.safetensors (or shards plus the index) into an existing folder; `metadata` is
    added to every file's safetensors metadata."""
    meta = {"format": "pt", **(metadata or {})}
    shards = _shards(state, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(folder / WEIGHTS_NAME), metadata=meta)
        return
    weight_map, total = {}, 0
    for k, shard in enumerate(shards, start=1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata=meta)
        for tensor_name, t in shard.items():
            weight_map[tensor_name] = name
            total += t.numel() * t.element_size()
    write_json(folder / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
