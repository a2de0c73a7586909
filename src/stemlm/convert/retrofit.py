"""Initialisations of retrofitted STEM tables beyond `E · W_upᵀ`, and the measurement of what each layer sees.

`retrofit_from_dense` sets U_l[t] = W_up_l · E[t]: the up-projection of the RAW embedding.
A dense layer never sees that vector: its FFN input is `h_l = RMSNorm_l(x_l)` (the residual stream after
attention, normalised and scaled by the norm weight). Two better starting points, chosen by `init`:

- "normed":  U_l[t] = W_up_l · RMSNorm_l(E[t]) (the layer's own FFN norm applied to the embedding; at layer 0
  x_0 = E[t] + attention output, so this is the dense input minus what attention added);
- "calib":   U_l[t] = mean over occurrences of t in a calibration text of W_up_l · h_l (the least-squares best
  context-free row for the inputs actually seen), falling back to "normed" for tokens never seen.

`ffn_input_alignment` measures, per layer, the cosine between h_l and RMSNorm_l(E[t]) at each position: how
much of the FFN input is still "the token" (high at layer 0, falling with depth), which is why a token-indexed
table can stand in for W_up h at layer 0 and not deeper.

    from stemlm.convert.retrofit import retrofit
    stem = retrofit(dense, "0", init="calib", calibration_ids=ids)
    adapter = adapter_from(dense, stem)        # ffn "stem_adapter": W_up x and U[t] blended by a learned gate

`adapter_from` builds the official code's adapter variant (`stemlm.model.kinds.stem_adapter`): the dense layer kept
whole and blended per channel with the table, the blend starting near 0, so the retrofit starts at the dense model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from stemlm.choices import RETROFIT_INITS
from stemlm.errors import StemlmError
from stemlm.model.config import resolve_layer_spec
from stemlm.model.decoder import StemLM

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
    stem_config = config.replace(ffn="stem", ffn_layers=layers)
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


# Calibration forwards run on windows of this many tokens (bounded memory; positions past it never needed).
CALIB_WINDOW = 1024


@torch.no_grad()
def normed_table(model: StemLM, layer: int) -> torch.Tensor:
    """W_up_l · RMSNorm_l(E[t]) for every token t: [V, d_ff] in fp32."""
    block = model.model.layers[layer]
    embedding = model.model.embed_tokens.weight.float()
    rows = []
    for start in range(0, embedding.shape[0], 8192):  # bounds the [rows, d_ff] temporary
        normed = block.post_attention_layernorm(embedding[start : start + 8192]).float()
        rows.append(normed @ block.mlp.up_proj.weight.float().t())
    return torch.cat(rows)


@torch.no_grad()
def ffn_inputs(model: StemLM, ids: torch.Tensor, layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """The FFN input h_l [N, d] of each layer in `layers` at every position of `ids` (windows of CALIB_WINDOW)."""
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    hooks = [
        model.model.layers[i].mlp.register_forward_pre_hook(
            lambda _m, args, i=i: seen[i].append(args[0].reshape(-1, args[0].shape[-1]).float())
        )
        for i in layers
    ]
    try:
        for start in range(0, ids.numel(), CALIB_WINDOW):
            model(ids[start : start + CALIB_WINDOW][None])
    finally:
        for hook in hooks:
            hook.remove()
    return {i: torch.cat(v) for i, v in seen.items()}


@torch.no_grad()
def calibrated_table(model: StemLM, layer: int, ids: torch.Tensor, inputs: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Mean of W_up_l · h_l over each token's occurrences; "normed" rows for unseen tokens. Also: tokens seen."""
    up = inputs @ model.model.layers[layer].mlp.up_proj.weight.float().t()  # [N, d_ff]
    vocab = model.config.vocab_size
    sums = torch.zeros(vocab, up.shape[1])
    counts = torch.zeros(vocab)
    flat = ids.reshape(-1)
    sums.index_add_(0, flat, up)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
    table = normed_table(model, layer)
    seen = counts > 0
    table[seen] = sums[seen] / counts[seen, None]
    return table, int(seen.sum())


def calibration_ids(tokenizer, paths: list[str] | None, max_tokens: int) -> torch.Tensor:
    """The first `max_tokens` token ids of the calibration text (files/folders, or the embedded train split)."""
    if tokenizer is None:
        raise StemlmError("init 'calib' needs the checkpoint's tokenizer.json to encode the calibration text")
    if max_tokens < 2:
        raise StemlmError(f"--calibration-tokens must be at least 2, got {max_tokens}")
    if paths:
        from stemlm.data.sources import read_texts

        texts = read_texts(paths)
    else:
        from stemlm.data.corpus import embedded_texts

        texts = embedded_texts("train")
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.encode(text[: max_tokens * 16], add_special_tokens=False).ids)  # >= 1 char per token
        if len(ids) >= max_tokens:
            break
    if len(ids) < 2:
        raise StemlmError("the calibration text encodes to fewer than 2 tokens")
    return torch.tensor(ids[:max_tokens])


@torch.no_grad()
def retrofit(
    dense: StemLM, stem_layers_spec: str | list[int], init: str = "embed", calibration_ids: torch.Tensor | None = None
) -> StemLM:
    """A retrofitted STEM model with its tables initialised by `init` (see the module docstring)."""
    if init not in RETROFIT_INITS:
        raise StemlmError(f"unknown retrofit init {init!r}; choose one of {', '.join(RETROFIT_INITS)}")
    if init == "calib" and (calibration_ids is None or calibration_ids.numel() < 2):
        raise StemlmError("init 'calib' needs calibration text (at least 2 tokens)")
    stem = retrofit_from_dense(dense, stem_layers_spec)
    if init == "embed":
        return stem
    layers = resolve_layer_spec(stem_layers_spec, dense.config.num_hidden_layers)
    inputs = ffn_inputs(dense, calibration_ids.reshape(-1), layers) if init == "calib" else {}
    for i in layers:
        if init == "calib":
            table, _ = calibrated_table(dense, i, calibration_ids.reshape(-1), inputs[i])
        else:
            table = normed_table(dense, i)
        weight = stem.model.layers[i].mlp.stem_embedding.weight
        weight.copy_(table.to(weight.dtype))
    return stem


@torch.no_grad()
def adapter_from(dense: StemLM, stem: StemLM) -> StemLM:
    """The `stem_adapter` model: every dense weight kept (up_proj included), `stem`'s tables, gate logits 0."""
    layers = sorted(stem.token_tables())
    config = dense.config.replace(ffn="stem_adapter", ffn_layers=layers)
    state = {k: v.clone() for k, v in dense.state_dict().items()}
    for i in layers:
        state[f"model.layers.{i}.mlp.stem_embedding.weight"] = stem.model.layers[i].mlp.stem_embedding.weight.clone()
        state[f"model.layers.{i}.mlp.adapter_gate"] = torch.zeros(config.intermediate_size)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    with torch.device("meta"):
        model = StemLM(config)
    model.load_state_dict(state, assign=True)
    model.tie_weights()
    model.reset_buffers(dense.model.embed_tokens.weight.device)
    return model.train(dense.training)


@torch.no_grad()
def ffn_input_alignment(model: StemLM, ids: torch.Tensor) -> list[dict[str, float]]:
    """Per layer: mean cosine between the FFN input h_l and RMSNorm_l(E[t]) at the same position, and between
    W_up_l h_l and W_up_l RMSNorm_l(E[t]) (what a table row must reproduce). Dense models only."""
    layers = list(range(model.config.num_hidden_layers))
    flat = ids.reshape(-1)
    inputs = ffn_inputs(model, flat, layers)
    embedding = model.model.embed_tokens.weight[flat].float()
    out = []
    for i in layers:
        block = model.model.layers[i]
        if not hasattr(block.mlp, "up_proj") or not hasattr(block.mlp, "gate_proj"):
            raise StemlmError(f"layer {i} is not a dense FFN; measure the alignment on the dense model")
        token = block.post_attention_layernorm(embedding).float()
        up = block.mlp.up_proj.weight.float()
        cos_in = torch.nn.functional.cosine_similarity(inputs[i], token, dim=-1).mean().item()
        cos_up = torch.nn.functional.cosine_similarity(inputs[i] @ up.t(), token @ up.t(), dim=-1).mean().item()
        out.append({"layer": i, "cos_input": cos_in, "cos_up": cos_up})
    return out
