"""Angular spread: how spread out STEM table rows are, per layer, against a dense model's `W_up x` vectors.

The paper's claim: STEM rows have low pairwise cosine similarity, a wider angular spread than the
up-projection outputs of a dense FFN, so less interference between the memories of different tokens.
For a set of distinct tokens taken from real text we compare, layer by layer,

- the STEM rows `U_l[t]` of those tokens, against
- the baseline vectors of the same tokens at the same layer: a dense checkpoint's `up_proj(x)` at each
  token's first occurrence in the text (x = that layer's post-attention-norm input), or, without a dense
  checkpoint, the STEM model's own `gate_proj(x)` outputs (the context-dependent half of the same product;
  the result says which baseline was used).

Statistics of the off-diagonal cosines: mean, std, mean |cos| and percentiles. `plot_spread` draws the
two distributions per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from stemlm.errors import StemlmError
from stemlm.model.decoder import StemLM
from stemlm.model.kinds.registry import key_label, key_layer

PERCENTILES = (1, 5, 25, 50, 75, 95, 99)


def first_occurrences(ids: Sequence[int], max_tokens: int) -> tuple[list[int], list[int]]:
    """(distinct token ids, position of each one's first occurrence), at most `max_tokens`, in text order."""
    seen: dict[int, int] = {}
    for pos, t in enumerate(ids):
        if t not in seen:
            seen[int(t)] = pos
            if len(seen) == max_tokens:
                break
    return list(seen), list(seen.values())


def pairwise_cosines(vectors: torch.Tensor) -> torch.Tensor:
    """The off-diagonal (i < j) cosine similarities of the rows of `vectors` [N, width], as a flat tensor."""
    unit = torch.nn.functional.normalize(vectors.double(), dim=-1)
    sims = unit @ unit.T
    i, j = torch.triu_indices(len(vectors), len(vectors), offset=1)
    return sims[i, j]


def cosine_stats(cos: torch.Tensor) -> dict:
    q = torch.quantile(cos.float(), torch.tensor([p / 100 for p in PERCENTILES]))
    return {
        "pairs": int(cos.numel()),
        "mean": float(cos.mean()),
        "std": float(cos.std()),
        "mean_abs": float(cos.abs().mean()),
        "percentiles": {str(p): float(v) for p, v in zip(PERCENTILES, q, strict=True)},
    }


@torch.no_grad()
def ffn_inputs(model: StemLM, ids: Sequence[int]) -> dict[int, torch.Tensor]:
    """Each layer's FFN input (the post-attention-norm output) at every position of `ids`, [T, d].

    A text longer than the model's context is run as consecutive windows of `max_position_embeddings` tokens.
    Captured with temporary forward hooks on the norms (removed before returning): analysis is single-call,
    and this keeps the model code free of analysis flags."""
    window, device = model.config.max_position_embeddings, next(model.parameters()).device
    captured: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(model.model.layers))}
    handles = [
        layer.post_attention_layernorm.register_forward_hook(
            lambda _m, _inp, out, i=i: captured[i].append(out[0].detach())
        )
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        for start in range(0, len(ids), window):
            model(torch.tensor([list(ids[start : start + window])], device=device))
    finally:
        for h in handles:
            h.remove()
    return {i: torch.cat(parts) for i, parts in captured.items()}


@torch.no_grad()
def spread_vectors(
    model: StemLM, ids: Sequence[int], dense: StemLM | None = None, max_tokens: int = 512
) -> tuple[list[int], dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """(distinct tokens, {STEM layer: (their STEM rows [N, d_ff], their baseline vectors [N, d_ff])})."""
    tables = model.token_tables()
    if not tables:
        raise StemlmError("angular spread needs a STEM model (this checkpoint has no STEM tables)")
    if dense is not None and dense.config.num_hidden_layers != model.config.num_hidden_layers:
        raise StemlmError("the dense checkpoint must have as many layers as the STEM one to compare layer by layer")
    ids = list(ids)
    tokens, positions = first_occurrences(ids, max_tokens)
    if len(tokens) < 3:
        raise StemlmError("the text has fewer than 3 distinct tokens; pass a longer text")
    base_model = dense if dense is not None else model
    inputs = ffn_inputs(base_model, ids)
    out = {}
    for key, table in tables.items():
        layer = key_layer(model.config, key)  # a side table (value embeddings beside the FFN) sits past the layers
        mlp = base_model.model.layers[layer].mlp
        proj = getattr(mlp, "up_proj", None) if dense is not None else mlp.gate_proj
        if proj is None:
            raise StemlmError(f"layer {layer} of the dense checkpoint has no up_proj (is it a STEM layer there?)")
        rows = table.weight[torch.tensor(tokens, device=table.weight.device)]
        out[key] = (rows.detach(), proj(inputs[layer][positions]).detach())
    return tokens, out


def angular_spread(
    model: StemLM, ids: Sequence[int], *, dense: StemLM | None = None, max_tokens: int = 512
) -> tuple[dict, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """(per-table cosine statistics of STEM rows vs baseline vectors, keyed by table key with its `label`; the raw
    cosines for `plot_spread`, keyed by that label)."""
    tokens, vectors = spread_vectors(model, ids, dense, max_tokens)
    samples = {
        key_label(model.config, key): (pairwise_cosines(rows), pairwise_cosines(base))
        for key, (rows, base) in vectors.items()
    }
    layers = {}
    for key, (rows, base) in vectors.items():
        label = key_label(model.config, key)
        # Also after removing the mean vector: a direction shared by every token (common in residual streams)
        # raises all raw cosines. Centred cosines average ~0 by construction, so their mean |cos| is reported.
        layers[str(key)] = {
            "label": label,
            "stem_rows": {**cosine_stats(samples[label][0]), "centred_mean_abs": _centred_mean_abs(rows)},
            "baseline": {**cosine_stats(samples[label][1]), "centred_mean_abs": _centred_mean_abs(base)},
        }
    result = {
        "tokens": len(tokens),
        "baseline": "dense up_proj(x)" if dense is not None else "STEM model's own gate_proj(x) (no --dense given)",
        "layers": layers,
    }
    return result, samples


def _centred_mean_abs(vectors: torch.Tensor) -> float:
    return float(pairwise_cosines(vectors - vectors.mean(0)).abs().mean())


def plot_spread(samples: dict, baseline_name: str, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(samples), figsize=(4 * len(samples), 3.2), squeeze=False)
    for ax, (label, (rows, base)) in zip(axes[0], samples.items(), strict=True):
        bins = torch.linspace(-1, 1, 81).tolist()
        ax.hist(base.float().numpy(), bins=bins, alpha=0.6, density=True, label=baseline_name)
        ax.hist(rows.float().numpy(), bins=bins, alpha=0.6, density=True, label="STEM rows")
        ax.set_title(f"{label}: {len(rows):,} token pairs")
        ax.set_xlabel("cosine similarity of a pair of distinct tokens' vectors")
        ax.set_ylabel("density (histogram area 1)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("angular spread: STEM table rows vs the baseline's up-projections", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
