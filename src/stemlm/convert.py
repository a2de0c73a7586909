"""Retrofit a dense model into a STEM model: each chosen layer's up-projection becomes a token table.

`retrofit_from_dense(dense, spec)` builds a STEM model whose table at layer l is `U_l = E · W_up_lᵀ` (the
token embedding matrix [V, d] times that layer's up-projection transposed, [V, d_ff]), as later official STEM
commits do, drops those up-projections and copies every other weight. Row t of U_l is exactly
`up_proj_l(embed(t))`: the up-projection of the RAW embedding of t, not of the normalised hidden state the
dense layer saw, so the retrofit is a starting point for training (`stemlm train --init-from`), not a model
with the dense logits. `convert_checkpoint` does this for a stemlm dense checkpoint (or run folder) or a local
Hugging Face Llama folder and writes a checkpoint with the tokenizer copied; the CLI is `stemlm convert`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer

from stemlm.checkpoint import save_pretrained
from stemlm.config import resolve_layer_spec
from stemlm.errors import StemlmError
from stemlm.model.decoder import StemLM
from stemlm.safe_write import check_target

PRODUCER = "stemlm convert"  # names convert's outputs in their manifest (what --force may replace)
# Rows of U_l computed per matmul: bounds the fp32 temporary at 128k-vocab, 8k-wide scale to ~1 GiB.
ROW_CHUNK = 32768


@torch.no_grad()
def retrofit_table(embedding: torch.Tensor, up_proj: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """U = E · W_upᵀ ([V, d] @ [d, d_ff] -> [V, d_ff]), accumulated in >= fp32, stored in `dtype` (default: E's)."""
    dtype = dtype or embedding.dtype
    compute = torch.promote_types(embedding.dtype, torch.float32)  # never accumulate below fp32
    weight = up_proj.to(compute).t()
    table = torch.empty(embedding.shape[0], up_proj.shape[0], dtype=dtype, device=embedding.device)
    for start in range(0, embedding.shape[0], ROW_CHUNK):
        rows = embedding[start : start + ROW_CHUNK].to(compute)
        table[start : start + ROW_CHUNK] = (rows @ weight).to(dtype)
    return table


def _check_dense(model: StemLM) -> None:
    if model.config.special_layers:
        raise StemlmError(
            f"retrofit needs a dense model, but this one has {model.config.ffn!r} FFNs in layers "
            f"{model.config.special_layers}; convert a dense checkpoint (ffn 'dense')"
        )


@torch.no_grad()
def retrofit_from_dense(dense_model: StemLM, stem_layers_spec: str | list[int]) -> StemLM:
    """A STEM model with tables U_l = E · W_up_lᵀ in the layers of `stem_layers_spec`, all else copied."""
    _check_dense(dense_model)
    config = dense_model.config
    layers = resolve_layer_spec(stem_layers_spec, config.num_hidden_layers)
    if not layers:
        raise StemlmError(f"stem layer spec {stem_layers_spec!r} selects no layer; nothing to retrofit")
    stem_config = config.replace(ffn="stem", stem_layers=layers)
    embedding = dense_model.model.embed_tokens.weight
    dropped = {f"model.layers.{i}.mlp.up_proj.weight" for i in layers}
    if config.tie_word_embeddings:
        dropped.add("lm_head.weight")
    # clone: the new model must not share storage with the dense one (training it would change both).
    state = {k: v.clone() for k, v in dense_model.state_dict().items() if k not in dropped}
    for i in layers:
        up = dense_model.model.layers[i].mlp.up_proj.weight
        state[f"model.layers.{i}.mlp.stem_embedding.weight"] = retrofit_table(embedding, up)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    with torch.device("meta"):
        model = StemLM(stem_config)
    model.load_state_dict(state, assign=True)
    model.tie_weights()
    model.reset_buffers(embedding.device)
    return model.train(dense_model.training)


def load_dense(path: str | Path) -> tuple[StemLM, Tokenizer | None]:
    """A dense model and its tokenizer from a stemlm checkpoint or run folder, or a local HF Llama folder."""
    from stemlm.runs import load_checkpoint

    return load_checkpoint(path)


def convert_checkpoint(
    source: str | Path,
    stem_layers_spec: str,
    out: str | Path,
    *,
    force: bool = False,
    init: str = "embed",
    calibration: list[str] | None = None,
    calibration_tokens: int = 32768,
    adapter: bool = False,
) -> Path:
    """Retrofit the dense model at `source` and save it, tokenizer included, as a stemlm checkpoint at `out`.

    `init` picks the tables' start (see `stemlm.retrofit`): "embed" (E · W_upᵀ), "normed", or "calib" (the FFN
    inputs seen on the first `calibration_tokens` tokens of the `calibration` files; default: the embedded
    corpus' train split). `adapter` keeps W_up and blends it with the table by a learned gate (`stem_adapter`).

    An existing non-empty `out` is refused unless `force` and it is an earlier output of `stemlm convert`;
    `out` is never the source nor a folder holding it (`stemlm.safe_write.check_target`).
    """
    guard = {"producer": PRODUCER, "force": force, "sources": _sources(source)}
    check_target(out, **guard)  # before the (possibly long) load
    dense, tokenizer = load_dense(source)
    if init == "embed":
        stem = retrofit_from_dense(dense, stem_layers_spec)
    else:
        from stemlm.retrofit import calibration_ids, retrofit

        ids = calibration_ids(tokenizer, calibration, calibration_tokens) if init == "calib" else None
        stem = retrofit(dense, stem_layers_spec, init, ids)
    if adapter:
        from stemlm.retrofit import adapter_from

        stem = adapter_from(dense, stem)
    return save_pretrained(stem, out, tokenizer=tokenizer, **guard)


def _sources(source: str | Path) -> list[Path]:
    """The source argument and, for a run folder, the checkpoint it resolves to."""
    from stemlm.runs import resolve_checkpoint

    paths = [Path(source)]
    try:
        paths.append(resolve_checkpoint(source))
    except StemlmError:
        pass  # an HF Llama folder, or a missing path (load_dense names that problem)
    return paths
