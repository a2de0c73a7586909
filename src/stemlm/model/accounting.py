"""Exact parameter, FLOP and memory-traffic accounting of a `ModelConfig`, computed from the config alone.

Nothing is allocated, so the 6.7B-parameter `paper-1b-counts` is inspected instantly. The attention, embedding
and norm figures are counted here; what a layer's kind adds comes from the kind itself (`Kind.count`, a `LayerCount`
of parameters, matmul weights and table rows per token; stemlm.model.kinds), and so do the components. The tests
check every figure against `build_model(config, device="meta")` and `torch.utils.flop_counter` on real
forwards. `stemlm info` prints `summarize(config, seq_len)`. Conventions, stated once:

- FLOPs are forward FLOPs = 2 x multiply-accumulates (MACs), counting matmuls only: each weight entry used in a
  matmul costs 2 FLOPs per token. Lookups (token embedding, STEM / PLE table rows) are not FLOPs, nor are
  norms, RoPE, softmax, SiLU, residual adds (what `FlopCounterMode` counts too). Training ~ 3 x forward
  (backward = 2 x forward), the usual convention.
- Attention scores (QK^T and AV, 4 * heads * head_dim FLOPs per query-key pair: under GQA every query head
  still scores against its group's key/value head, so the count is per query head, whether k/v are repeated
  or shared through SDPA's `enable_gqa`; FlopCounterMode's SDPA formula, `sdpa_flop_count`, counts the same)
  are `causal` by default: a length-L prefill has L(L+1)/2 query-key pairs, (L+1)/2 keys per token on
  average. `full` counts L keys per token: what the seed's formula assumes and what math SDPA (and
  FlopCounterMode's SDPA formula, which ignores `is_causal`) computes. A decode step at context L reads L keys.
- Active parameters per token. `active_backbone` = every parameter except the lookup tables (a kind's
  `table_components`) and the parameters a token does not use (`LayerCount.inactive`: the experts it is not
  routed to); the input embedding counts in full, as in the paper's 1.41B for the 1B STEM model.
  `active_with_rows` adds the rows a token looks up (d_ff per STEM layer, ple_dim per PLE layer, ...).
- Decode reads the parameters one new token touches (distinct entries: one embedding row, unless tied, where
  the row lies inside the lm_head already; one row per table layer; k experts; all other weights), times the
  dtype size, plus optionally the KV cache of the context.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from stemlm.errors import StemlmError
from stemlm.model.config import ModelConfig
from stemlm.model.kinds.registry import all_kinds, beside_kinds, get_kind, ordered_union

_KINDS = all_kinds()
PARAM_COMPONENTS = ordered_union([("embed_tokens", "lm_head", "attention", "norms"), *(k.components for k in _KINDS)])
TABLE_COMPONENTS = ordered_union(k.table_components for k in _KINDS)
SCALAR_COMPONENTS = ordered_union(k.scalar_components for k in _KINDS)
FLOP_COMPONENTS = (
    "attn_proj",
    "attn_scores",
    *ordered_union(tuple(c for c in k.components if c not in k.table_components + k.scalar_components) for k in _KINDS),
    "lm_head",
)
ATTENTION_MODES = ("causal", "full")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


# ----------------------------------------------------------------------------------------------------------
# per layer
# ----------------------------------------------------------------------------------------------------------
def _layer(config: ModelConfig, layer_idx: int) -> tuple[dict[str, int], dict[str, int], int, int]:
    """(parameters by component, matmul weights one token uses by component, table row width looked up,
    parameters a token does not use)."""
    d = config.hidden_size
    q_width, kv_width = config.num_attention_heads * config.head_size, config.kv_heads * config.head_size
    attention = d * q_width + 2 * d * kv_width + q_width * d
    params = {"attention": attention, "norms": 2 * d}
    used = {"attention": attention}
    kind = get_kind(config.layer_ffn(layer_idx))
    parts = [(kind, kind.count(config, layer_idx))]  # the FFN kind, then the kinds beside it (their side modules)
    parts += [
        (get_kind(name), get_kind(name).beside.count(config, layer_idx)) for name in config.layer_sides(layer_idx)
    ]
    rows = inactive = 0
    for kind, part in parts:
        unknown = sorted((set(part.params) | set(part.matmul)) - set(PARAM_COMPONENTS))
        if unknown:
            raise StemlmError(f"kind {kind.name!r} counts components {unknown} it does not declare (Kind.components)")
        _add(params, part.params)
        _add(used, part.matmul)
        rows, inactive = rows + part.rows, inactive + part.inactive
    return params, used, rows, inactive


def _add(total: dict[str, int], part: dict[str, int]) -> None:
    for key, value in part.items():
        total[key] = total.get(key, 0) + value


def _check_mode(attention: str) -> None:
    if attention not in ATTENTION_MODES:
        raise StemlmError(f"attention must be one of {', '.join(ATTENTION_MODES)}, got {attention!r}")


def _check_len(seq_len: int) -> None:
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise StemlmError(f"sequence length must be a positive integer, got {seq_len!r}")


# ----------------------------------------------------------------------------------------------------------
# parameters
# ----------------------------------------------------------------------------------------------------------
def parameter_counts(config: ModelConfig) -> dict[str, int]:
    """Parameters by component (every key of PARAM_COMPONENTS, zeros included); a tied lm_head counts 0."""
    d, V = config.hidden_size, config.vocab_size
    counts = dict.fromkeys(PARAM_COMPONENTS, 0)
    counts["embed_tokens"] = V * d
    counts["lm_head"] = 0 if config.tie_word_embeddings else V * d
    counts["norms"] = d  # final norm; the per-layer norms are added below
    for i in range(config.num_hidden_layers):
        _add(counts, _layer(config, i)[0])
    return counts


def total_parameters(config: ModelConfig) -> int:
    return sum(parameter_counts(config).values())


def matmul_weights_per_token(config: ModelConfig) -> dict[str, int]:
    """Weight entries one token multiplies (each costs one MAC): projections, active experts, lm_head."""
    used = {"lm_head": config.vocab_size * config.hidden_size}
    for i in range(config.num_hidden_layers):
        _add(used, _layer(config, i)[1])
    return used


def rows_per_token(config: ModelConfig) -> int:
    """Table entries one token looks up: d_ff per STEM / STEM-gate layer, ple_dim per PLE layer."""
    return sum(_layer(config, i)[2] for i in range(config.num_hidden_layers))


def active_parameters(config: ModelConfig) -> dict[str, int]:
    """`backbone` (paper convention: no tables, embedding in full), `with_rows`, `rows`, and `matmul`."""
    counts = parameter_counts(config)
    inactive = sum(counts[k] for k in TABLE_COMPONENTS)
    used = matmul_weights_per_token(config)
    inactive += sum(_layer(config, i)[3] for i in range(config.num_hidden_layers))
    backbone = sum(counts.values()) - inactive
    rows = rows_per_token(config)
    return {"backbone": backbone, "with_rows": backbone + rows, "rows": rows, "matmul": sum(used.values())}


def distinct_token_count(config: ModelConfig, token_ids: Any) -> int:
    """Number of distinct ids in a token id tensor / array / (nested) list, checked against the vocabulary."""
    if hasattr(token_ids, "reshape") and hasattr(token_ids, "tolist"):  # torch tensor or numpy array
        flat = token_ids.reshape(-1).tolist()
    else:
        flat = list(_flatten(token_ids))
    ids = set(flat)
    for t in ids:
        if not isinstance(t, int) or not 0 <= t < config.vocab_size:
            raise StemlmError(f"token id {t!r} is not an id of a vocabulary of {config.vocab_size}")
    return len(ids)


def _flatten(items: Any) -> Iterable[Any]:
    if isinstance(items, (list, tuple)):
        for item in items:
            yield from _flatten(item)
    else:
        yield items


def activated_table_parameters(config: ModelConfig, token_ids: Any) -> int:
    """Table parameters a sequence (or a whole batch) reads: `|S| * d_ff * L_uniq` for STEM (the seed's
    "test-time capacity"), with L_uniq the distinct ids; PLE layers add ple_dim * L_uniq each."""
    return rows_per_token(config) * distinct_token_count(config, token_ids)


# ----------------------------------------------------------------------------------------------------------
# FLOPs
# ----------------------------------------------------------------------------------------------------------
def _score_flops_per_pair(config: ModelConfig) -> int:
    # QK^T and AV: head_dim MACs each per query head and key, i.e. 4 * heads * head_dim FLOPs per pair and layer.
    return 4 * config.num_attention_heads * config.head_size * config.num_hidden_layers


def _pairs(seq_len: int, attention: str) -> int:
    return seq_len * (seq_len + 1) // 2 if attention == "causal" else seq_len * seq_len


def forward_flops_per_token(config: ModelConfig, seq_len: int, attention: str = "causal") -> dict[str, float]:
    """Forward FLOPs per token of a length-`seq_len` prefill (or training sequence), by FLOP_COMPONENTS + total."""
    _check_mode(attention)
    _check_len(seq_len)
    used = matmul_weights_per_token(config)
    flops: dict[str, float] = {k: 2 * used.get("attention" if k == "attn_proj" else k, 0) for k in FLOP_COMPONENTS}
    flops["attn_scores"] = _score_flops_per_pair(config) * _pairs(seq_len, attention) / seq_len
    flops["total"] = sum(flops.values())
    return flops


def prefill_flops(config: ModelConfig, seq_len: int, batch_size: int = 1, attention: str = "causal") -> int:
    """Exact forward FLOPs of `batch_size` sequences of `seq_len` tokens (logits at every position)."""
    _check_mode(attention)
    _check_len(seq_len)
    per_token = 2 * active_parameters(config)["matmul"]
    return batch_size * (seq_len * per_token + _score_flops_per_pair(config) * _pairs(seq_len, attention))


def training_flops_per_token(config: ModelConfig, seq_len: int, attention: str = "causal") -> float:
    """3 x forward: the backward pass costs about two forwards (gradients wrt activations and wrt weights)."""
    return 3 * forward_flops_per_token(config, seq_len, attention)["total"]


def decode_flops_per_token(config: ModelConfig, context_len: int) -> int:
    """Forward FLOPs of one new token attending to `context_len` keys (itself included)."""
    _check_len(context_len)
    return 2 * active_parameters(config)["matmul"] + _score_flops_per_pair(config) * context_len


# ----------------------------------------------------------------------------------------------------------
# decode memory traffic
# ----------------------------------------------------------------------------------------------------------
def decode_params_touched(config: ModelConfig) -> int:
    """Distinct parameters one decode step reads: norms (and the kinds' other non-matmul parameters, such as
    mixing weights), matmul weights, one row per table, one embedding row."""
    counts = parameter_counts(config)
    norms = counts["norms"] + sum(counts[c] for c in SCALAR_COMPONENTS)
    embedding_row = 0 if config.tie_word_embeddings else config.hidden_size
    return norms + sum(matmul_weights_per_token(config).values()) + rows_per_token(config) + embedding_row


def kv_cache_bytes(config: ModelConfig, context_len: int, dtype_bytes: int = 2, batch_size: int = 1) -> int:
    """Bytes of keys and values for `context_len` positions (read in full by every decode step)."""
    return 2 * config.num_hidden_layers * config.kv_heads * config.head_size * context_len * dtype_bytes * batch_size


def decode_bytes_per_token(
    config: ModelConfig, context_len: int = 0, dtype_bytes: int = 2, kv_dtype_bytes: int | None = None
) -> dict[str, int]:
    """Memory read by one decode step at batch size 1: weights touched, KV cache at `context_len`, and the sum."""
    weights = decode_params_touched(config) * dtype_bytes
    kv = kv_cache_bytes(config, context_len, kv_dtype_bytes or dtype_bytes) if context_len else 0
    return {"weights": weights, "kv_cache": kv, "total": weights + kv}


# ----------------------------------------------------------------------------------------------------------
# STEM savings
# ----------------------------------------------------------------------------------------------------------
def seed_saving_fraction(hidden_size: int, intermediate_size: int, seq_len: int) -> float:
    """The seed's per-STEM-layer saving d_ff / (4d + 2L + 3 d_ff).

    It is (MACs saved) / (MACs of the dense layer) per token with MHA, full attention and SwiGLU:
    q, k, v, o = 4d^2; QK^T + AV = 2Ld; gate, up, down = 3 d d_ff; the up-projection saved = d d_ff; divide by d.
    """
    return intermediate_size / (4 * hidden_size + 2 * seq_len + 3 * intermediate_size)


def seed_flops_saved(batch_size: int, seq_len: int, hidden_size: int, intermediate_size: int) -> int:
    """The seed's Delta F = B * L * d * d_ff multiply-accumulates saved per STEM layer (x2 for FLOPs)."""
    return batch_size * seq_len * hidden_size * intermediate_size


def layer_flops(config: ModelConfig, layer_idx: int, seq_len: int, attention: str = "causal") -> float:
    """Forward FLOPs per token of one decoder layer (attention + FFN) in a length-`seq_len` prefill."""
    _check_mode(attention)
    _check_len(seq_len)
    used = _layer(config, layer_idx)[1]
    scores = _score_flops_per_pair(config) / config.num_hidden_layers * _pairs(seq_len, attention) / seq_len
    return 2 * sum(used.values()) + scores


def layer_saving_fraction(
    config: ModelConfig, seq_len: int, attention: str = "causal", layer_idx: int | None = None
) -> float:
    """FLOPs a special layer (default: the first) saves vs its dense twin, as a fraction of the twin's FLOPs.

    Exact for this config (GQA shrinks k and v, head_dim may differ from d / heads); with MHA and
    attention="full" it equals `seed_saving_fraction`. Negative for kinds that add compute (PLE).
    """
    layers = config.special_layers
    if layer_idx is None:
        if not layers:
            raise StemlmError("the config has no STEM / special layers, so there is no layer saving to compute")
        layer_idx = layers[0]
    dense = layer_flops(config.replace(ffn="dense"), layer_idx, seq_len, attention)
    return (dense - layer_flops(config, layer_idx, seq_len, attention)) / dense


# ----------------------------------------------------------------------------------------------------------
# the paper's figures
# ----------------------------------------------------------------------------------------------------------
# Reported for the 1B models (PAPER.md): total / active parameters in billions and GFLOPs per token.
PAPER_1B = {
    "paper-1b-counts": {"total_b": 6.75, "active_b": 1.41, "gflops_per_token": 2.83},
    "paper-1b-counts-dense": {"total_b": 1.50, "active_b": 1.50, "gflops_per_token": 3.00},
}


def paper_convention(config: ModelConfig) -> dict[str, float]:
    """The counting that reproduces the paper's 1B figures: total = dense twin + the STEM tables (the replaced
    up-projections not subtracted); GFLOPs/token = 2 x active_backbone (embedding lookup counted, scores not)."""
    dense_total = total_parameters(config.replace(ffn="dense"))
    total = dense_total + parameter_counts(config)["token_tables"]
    return {"total": total, "gflops_per_token": 2 * active_parameters(config)["backbone"] / 1e9}


def _same(value: float, reported: float) -> bool:
    return abs(round(value, 2) - reported) < 1e-9


def paper_comparison(config: ModelConfig) -> dict[str, Any] | None:
    """Our figures beside the paper's for the paper-1b-counts shape (STEM or dense); None for any other config."""
    from stemlm.model.presets import get_preset

    def canonical(c: ModelConfig) -> ModelConfig:
        return c.replace(ffn_layers=c.special_layers)

    name = next((n for n in PAPER_1B if canonical(get_preset(n)) == canonical(config)), None)
    if name is None:
        return None
    paper, convention = PAPER_1B[name], paper_convention(config)
    active = active_parameters(config)
    return {
        "preset": name,
        "paper": paper,
        "ours": {
            "total": total_parameters(config),
            "active_backbone": active["backbone"],
            "gflops_per_token_matmuls_only": 2 * active["matmul"] / 1e9,
        },
        "paper_convention": convention,
        "reproduced": {  # to the paper's two decimals
            "total": _same(convention["total"] / 1e9, paper["total_b"]),
            "active": _same(active["backbone"] / 1e9, paper["active_b"]),
            "gflops_per_token": _same(convention["gflops_per_token"], paper["gflops_per_token"]),
        },
        "explanation": (
            (
                f"the paper's total adds the tables to the dense model without removing the "
                f"{len(config.special_layers)} replaced up-projections; "
                if config.special_layers
                else ""
            )
            + "the paper's GFLOPs/token are 2 x active parameters (the embedding lookup counted as a matmul, attention "
            "scores left out); ours count matmuls only, with attention scores at the given context"
        ),
    }


# ----------------------------------------------------------------------------------------------------------
# everything, JSON-ready
# ----------------------------------------------------------------------------------------------------------
def summarize(config: ModelConfig, seq_len: int, attention: str = "causal", dtype: str = "bf16") -> dict[str, Any]:
    """All figures for one config at context `seq_len` (the object `stemlm info --json` prints)."""
    if dtype not in DTYPE_BYTES:
        raise StemlmError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_BYTES)}")
    counts, active = parameter_counts(config), active_parameters(config)
    forward = forward_flops_per_token(config, seq_len, attention)
    dense_twin = config.replace(ffn="dense")
    dense_forward = forward_flops_per_token(dense_twin, seq_len, attention)["total"]
    out: dict[str, Any] = {
        "ffn": config.ffn,
        "special_layers": config.special_layers,
        "seq_len": seq_len,
        "attention": attention,
        "dtype": dtype,
        "parameters": {
            "total": sum(counts.values()),
            "components": counts,
            "active_backbone": active["backbone"],
            "active_with_rows": active["with_rows"],
            "rows_per_token": active["rows"],
            "matmul_per_token": active["matmul"],
        },
        "flops": {
            "forward_per_token": forward,
            "training_per_token": 3 * forward["total"],
            "forward_per_sequence": prefill_flops(config, seq_len, 1, attention),
            "saving_vs_dense_twin": (dense_forward - forward["total"]) / dense_forward,
        },
        "decode": {
            "context_len": seq_len,
            "flops_per_token": decode_flops_per_token(config, seq_len),
            "params_touched": decode_params_touched(config),
            "bytes_per_token": decode_bytes_per_token(config, seq_len, DTYPE_BYTES[dtype]),
        },
        "paper_convention": paper_convention(config),
    }
    beside = {k.name: layers for k in beside_kinds() if (layers := config.beside_layers(k.name))}
    if beside:  # kinds beside the FFN kind (value embeddings, Engram), by their layers
        out["beside"] = beside
    if get_kind(config.ffn).replaces_projection and config.special_layers:
        d, f = config.hidden_size, config.intermediate_size
        out["stem"] = {
            "layer_saving_fraction": layer_saving_fraction(config, seq_len, attention),
            "seed_saving_fraction": seed_saving_fraction(d, f, seq_len),
            "seed_flops_saved_per_layer_per_token": 2 * seed_flops_saved(1, 1, d, f),
        }
    comparison = paper_comparison(config)
    if comparison is not None:
        out["paper"] = comparison
    return out
