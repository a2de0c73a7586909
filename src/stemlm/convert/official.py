"""`stemlm convert --from-official DIR`: a checkpoint of the official STEM trainer as a stemlm model folder.

    stemlm convert --from-official dump/checkpoints/0000010000 --out ckpt/official-10k
    stemlm convert --from-official dump/checkpoints/0000010000/consolidated --out ckpt/official-10k

The layouts are those of Infini-AI-Lab/STEM `main` at dcc9b73 (`lingua/stem_checkpoint.py`, `lingua/checkpoint.py`):
- a step folder, as `StemCheckpointManager.save` writes it: the backbone through `dcp.save` of {"model": backbone
  state, "optim": ...} (`.metadata`, `__R_0.distcp`), the run's config as `params.json`, and
  `stem_shards/stem_model_mp{r}.pt` (`save_stem_shards`): STEM model-parallel rank r's columns of every table
  (`stem_embeddings.{j}.weight`, [V, d_ff / P]: `ParallelEmbedding` splits along the embedding dimension);
- a consolidated folder (`consolidate_checkpoints`): `consolidated.pth`, the same nested dict `torch.save`d,
  `params.json`, and the tables as `consolidated_stem.pth` (`consolidate_stem_shards`, the shards joined along
  dim 1) or as `stem_shards/`. The shards are joined in rank order (the official consolidation joins them in
  directory-listing order).
Files are read with DCP's reader and `torch.load(weights_only=True)` (tensors and plain containers only); only
the model's tensors are kept, optimizer state is dropped.

The conversion: official names to stemlm's (HF Llama names, `lm_transformer.` prefix dropped); q and k rows
permuted per head from the official RoPE layout, which rotates interleaved pairs (2i, 2i+1), to the rotate-half
layout, which pairs i with i + head_dim/2 (the same function after the permutation); table j to the j-th STEM
layer; the config from `params.json`'s "model" (d_ff by the official rounding, a tied run without an output
weight). The official runs use tiktoken / sentencepiece tokenizers: the folder is written without one.
Tests: tests/convert/test_official.py.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from stemlm.checkpoint.folder import save_pretrained
from stemlm.checkpoint.runs import fill_model
from stemlm.checkpoint.safe_write import check_target
from stemlm.errors import StemlmError
from stemlm.model import build_model
from stemlm.model.config import ModelConfig

PRODUCER = "stemlm convert"
PARAMS = "params.json"
STEM_DIR = "stem_shards"
SHARD = re.compile(r"stem_model_mp(\d+)\.pt")
LAYER_NAMES = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def official_ffn_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """The official FeedForward's hidden size for a block built with hidden_dim = 4 · dim."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def official_config(params: dict[str, Any]) -> ModelConfig:
    """The stemlm `ModelConfig` of an official run's `params.json` "model" section."""
    m = params.get("model")
    if not isinstance(m, dict):
        raise StemlmError(f'{PARAMS} has no "model" section: not an official STEM run config')
    if m.get("sliding_window") is not None:
        raise StemlmError(f"the official run uses sliding_window {m['sliding_window']}; stemlm has full attention only")
    dim, n_layers, n_heads = m["dim"], m["n_layers"], m.get("n_heads")
    head_dim = m.get("head_dim") or dim // n_heads
    n_heads = n_heads or dim // head_dim
    d_ff = official_ffn_dim(dim, m.get("multiple_of", 256), m.get("ffn_dim_multiplier"))
    stem_layers = m.get("stem_layers")
    stem_layers = list(range(1, n_layers)) if stem_layers is None else list(stem_layers)  # StemTransformer's default
    return ModelConfig(
        vocab_size=m["vocab_size"],
        hidden_size=dim,
        intermediate_size=d_ff,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=m.get("n_kv_heads") or n_heads,
        head_dim=head_dim,
        max_position_embeddings=m.get("max_seqlen", 1024),
        rope_theta=float(m.get("rope_theta", 10000.0)),
        rms_norm_eps=float(m.get("norm_eps", 1e-5)),
        tie_word_embeddings=bool(m.get("weight_tying", False)),
        ffn="stem" if stem_layers else "dense",
        ffn_layers=stem_layers,
    )


def rotate_half_rows(weight: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """q/k rows from interleaved-pair order to rotate-half order: row 2i + j of a head goes to j · head_dim/2 + i."""
    rows = weight.shape[1:]
    return weight.reshape(n_heads, head_dim // 2, 2, *rows).transpose(1, 2).reshape(n_heads * head_dim, *rows)


def stemlm_state(official: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The official model state (backbone and whole tables, official names) under stemlm's names and layout."""
    out: dict[str, torch.Tensor] = {}
    heads = {"attention.wq": config.num_attention_heads, "attention.wk": config.kv_heads}
    layers = config.special_layers
    for name, tensor in official.items():
        key = name.removeprefix("lm_transformer.")
        if key == "tok_embeddings.weight":
            out["model.embed_tokens.weight"] = tensor
        elif key == "norm.weight":
            out["model.norm.weight"] = tensor
        elif key == "output.weight":
            out["lm_head.weight"] = tensor
        elif match := re.fullmatch(r"stem_embeddings\.(\d+)\.weight", key):
            j = int(match[1])
            if j >= len(layers):
                raise StemlmError(f"the checkpoint has table {j} but its config names {len(layers)} STEM layers")
            out[f"model.layers.{layers[j]}.mlp.stem_embedding.weight"] = tensor
        elif match := re.fullmatch(r"layers\.(\d+)\.(.+)\.weight", key):
            index, part = match[1], match[2]
            if part not in LAYER_NAMES:
                raise StemlmError(f"unknown official tensor {name!r}")
            if part in heads:
                tensor = rotate_half_rows(tensor, heads[part], config.head_size)
            out[f"model.layers.{index}.{LAYER_NAMES[part]}.weight"] = tensor
        elif key != "rope_embeddings.freqs_cis":  # a buffer the official model may save; stemlm recomputes it
            raise StemlmError(f"unknown official tensor {name!r}")
    return out


def _load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError or EOFError for a damaged file
        raise StemlmError(f"cannot read {path}: {str(exc).splitlines()[0]}") from None


def _read_dcp_model(folder: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(folder))
    metadata = reader.read_metadata().state_dict_metadata
    model = {
        key.removeprefix("model."): torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": one process reads every rank's pieces
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": model}, storage_reader=reader, no_dist=True)
    return model


def _read_tables(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "consolidated_stem.pth").is_file():
        return dict(_load(folder / "consolidated_stem.pth"))
    shards = sorted(
        (int(m[1]), p) for p in (folder / STEM_DIR).glob("stem_model_mp*.pt") if (m := SHARD.fullmatch(p.name))
    )
    if [rank for rank, _ in shards] != list(range(len(shards))):
        raise StemlmError(
            f"{folder / STEM_DIR} must hold stem_model_mp0.pt ... mp{{P-1}}.pt, found ranks {[r for r, _ in shards]}"
        )
    parts = [dict(_load(path)) for _, path in shards]
    return {name: torch.cat([part[name] for part in parts], dim=1) for name in (parts[0] if parts else {})}


def read_official(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, stemlm-named state) of an official step folder or consolidated folder (module docstring)."""
    folder = Path(folder)
    if not (folder / PARAMS).is_file():
        raise StemlmError(f"{folder} has no {PARAMS}: not an official STEM checkpoint folder")
    try:
        config = official_config(json.loads((folder / PARAMS).read_text()))
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise StemlmError(f"{folder / PARAMS} is not an official run config ({exc!r})") from None
    if (folder / "consolidated.pth").is_file():
        saved = _load(folder / "consolidated.pth")
        backbone = saved.get("model", saved) if isinstance(saved, dict) else None
        if not isinstance(backbone, dict):
            raise StemlmError(f"{folder / 'consolidated.pth'} holds no model state dict")
    elif (folder / ".metadata").is_file():
        backbone = _read_dcp_model(folder)
    else:
        raise StemlmError(f"{folder} has neither consolidated.pth nor a DCP checkpoint (.metadata)")
    official = {k: v for k, v in backbone.items() if isinstance(v, torch.Tensor)}
    official.update(_read_tables(folder))
    return config, stemlm_state(official, config)


def convert_official(source: str | Path, out: str | Path, *, force: bool = False) -> Path:
    """Read the official checkpoint at `source` and write it as a stemlm model folder at `out` (no tokenizer)."""
    check_target(out, producer=PRODUCER, force=force, sources=(source,))
    config, state = read_official(source)
    model = fill_model(build_model(config, device="meta"), state, source)
    return save_pretrained(model, out, force=force, sources=(source,), producer=PRODUCER)
