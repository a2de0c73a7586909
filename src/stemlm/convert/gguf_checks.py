"""Checks of an untrusted GGUF file before `stemlm convert --from-gguf` writes anything from it.

A GGUF is a header of typed key/values and tensor descriptions that anyone can write, so nothing in it is taken
on trust: every metadata value the importer reads is checked for its type and range (`integer`, `number`,
`token_id`), the tokenizer's tokens, token types and merges for their form (`check_tokenizer`), and every
tensor's presence and shape against what the metadata implies for a Llama (`check_tensors`). Each refusal is
one `StemlmError` naming the GGUF field or tensor, raised before any file is written.
"""

from __future__ import annotations

import math
from typing import Any

from stemlm.errors import StemlmError
from stemlm.model.config import SIZE_LIMITS

# Metadata keys holding sizes -> the ModelConfig bound they become.
SIZE_KEYS = {
    "llama.embedding_length": SIZE_LIMITS["hidden_size"],
    "llama.feed_forward_length": SIZE_LIMITS["intermediate_size"],
    "llama.block_count": SIZE_LIMITS["num_hidden_layers"],
    "llama.attention.head_count": SIZE_LIMITS["num_attention_heads"],
    "llama.attention.head_count_kv": SIZE_LIMITS["num_key_value_heads"],
    "llama.attention.key_length": SIZE_LIMITS["head_dim"],
    "llama.context_length": SIZE_LIMITS["max_position_embeddings"],
}


def read_metadata(reader) -> dict[str, Any]:
    """Every key/value of the file as plain Python values (a string that is not UTF-8 is refused by key)."""
    meta = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except (UnicodeDecodeError, ValueError, IndexError) as exc:
            raise StemlmError(f"GGUF metadata {key} cannot be read ({type(exc).__name__})") from None
    return meta


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(meta: dict[str, Any], key: str, default: Any = None) -> int:
    """The positive integer at `key` (or `default` when absent), within its size bound."""
    value = meta.get(key, default)
    if value is None:
        raise StemlmError(f"GGUF metadata lacks {key}")
    if not _is_int(value):
        raise StemlmError(f"GGUF metadata {key} must be an integer, got {_describe(value)}")
    limit = SIZE_KEYS.get(key, 2**31)
    if not 0 < value <= limit:
        raise StemlmError(f"GGUF metadata {key} is {value}; it must be between 1 and {limit}")
    return value


def number(meta: dict[str, Any], key: str, default: Any = None) -> float:
    """The positive finite number at `key` (or `default` when absent)."""
    value = meta.get(key, default)
    if value is None:
        raise StemlmError(f"GGUF metadata lacks {key}")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise StemlmError(f"GGUF metadata {key} must be a positive finite number, got {_describe(value)}")
    return float(value)


def token_id(meta: dict[str, Any], key: str, vocab: int) -> int | None:
    """The token id at `key`, or None when absent; refused unless it names one of the `vocab` tokens."""
    if key not in meta:
        return None
    value = meta[key]
    if not _is_int(value) or not 0 <= value < vocab:
        raise StemlmError(f"GGUF metadata {key} is {_describe(value)}; it must be a token id in 0..{vocab - 1}")
    return value


def string(meta: dict[str, Any], key: str, default: str | None = None) -> str | None:
    value = meta.get(key, default)
    if value is not None and not isinstance(value, str):
        raise StemlmError(f"GGUF metadata {key} must be a string, got {_describe(value)}")
    return value


def _describe(value: Any) -> str:
    if isinstance(value, list):
        return f"an array of {len(value)}"
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def check_tokenizer(meta: dict[str, Any]) -> tuple[list[str], list[int], list[tuple[str, str]]]:
    """(tokens, token types, merges) of the GGUF's BPE tokenizer, each checked for its form."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise StemlmError("GGUF metadata tokenizer.ggml.tokens must be a non-empty array of strings")
    if len(set(tokens)) != len(tokens):
        raise StemlmError("GGUF metadata tokenizer.ggml.tokens lists a token twice")
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    if not isinstance(types, list) or not all(_is_int(t) for t in types):
        raise StemlmError("GGUF metadata tokenizer.ggml.token_type must be an array of integers")
    if len(types) != len(tokens):
        raise StemlmError(f"GGUF tokenizer has {len(tokens)} tokens but {len(types)} token types")
    raw = meta.get("tokenizer.ggml.merges", [])
    if not isinstance(raw, list) or not all(isinstance(m, str) for m in raw):
        raise StemlmError("GGUF metadata tokenizer.ggml.merges must be an array of strings")
    vocab = set(tokens)
    merges = []
    for i, merge in enumerate(raw):
        parts = merge.split(" ")
        if len(parts) != 2 or not all(parts) or not all(p in vocab for p in parts) or "".join(parts) not in vocab:
            raise StemlmError(
                f"GGUF metadata tokenizer.ggml.merges[{i}] is {_describe(merge)}; a merge is two tokens of the "
                "vocabulary separated by one space, whose concatenation is a token too"
            )
        merges.append((parts[0], parts[1]))
    return tokens, types, merges


def expected_shapes(config: dict[str, Any], tied: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama GGUF with this config holds, with its PyTorch shape ([out, in])."""
    hidden, ffn, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not tied:
        shapes["output.weight"] = (vocab, hidden)
    layer = {
        "attn_norm.weight": (hidden,),
        "attn_q.weight": (q, hidden),
        "attn_k.weight": (kv, hidden),
        "attn_v.weight": (kv, hidden),
        "attn_output.weight": (hidden, q),
        "ffn_norm.weight": (hidden,),
        "ffn_gate.weight": (ffn, hidden),
        "ffn_up.weight": (ffn, hidden),
        "ffn_down.weight": (hidden, ffn),
    }
    for i in range(config["num_hidden_layers"]):
        shapes.update({f"blk.{i}.{name}": shape for name, shape in layer.items()})
    return shapes


def check_tensors(tensors: dict[str, tuple[int, ...]], config: dict[str, Any], tied: bool) -> None:
    """Refuse a missing tensor or a shape the metadata does not imply (`tensors`: name -> PyTorch shape)."""
    expected = expected_shapes(config, tied)
    layers = config["num_hidden_layers"]
    for name, shape in expected.items():
        if name not in tensors:
            if name.startswith("blk.") and not any(t.startswith(f"blk.{name.split('.')[1]}.") for t in tensors):
                raise StemlmError(f"GGUF metadata llama.block_count is {layers} but the file has no tensors for {name}")
            raise StemlmError(f"GGUF file lacks tensor {name} (a Llama with llama.block_count {layers} has one)")
        if tuple(tensors[name]) != shape:
            raise StemlmError(
                f"GGUF tensor {name} has shape {list(tensors[name])}, but the metadata (llama.embedding_length, "
                f"head counts, feed_forward_length, token list) implies {list(shape)}"
            )
    for name in tensors:
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit() and int(parts[1]) >= layers:
            raise StemlmError(f"GGUF tensor {name} lies beyond llama.block_count {layers}")
