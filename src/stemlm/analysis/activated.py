"""Activated STEM parameters vs context length on real text: the paper's "test-time capacity scaling".

A sequence reads one row per STEM layer for each distinct token it contains, so the table parameters it
activates are `|S| * d_ff * L_uniq` (`stemlm.model.accounting.activated_table_parameters`), growing with context as
new tokens appear while the backbone's active parameters stay fixed. Here L_uniq is measured on windows of
real token ids at several context lengths (mean over windows) and reported beside the backbone's active
parameters; `plot_activated` draws both against context length.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from stemlm.errors import StemlmError
from stemlm.model.accounting import activated_table_parameters, active_parameters
from stemlm.model.config import ModelConfig
from stemlm.model.kinds.registry import get_kind


def context_lengths(max_len: int, start: int = 16) -> list[int]:
    """Powers of two from `start` up to `max_len`, plus `max_len` itself."""
    lengths, n = [], start
    while n < max_len:
        lengths.append(n)
        n *= 2
    return lengths + [max_len]


def activated_vs_context(
    config: ModelConfig, ids: Sequence[int], lengths: Sequence[int] | None = None, windows: int = 8
) -> dict:
    """Per context length: mean distinct tokens and activated table parameters over up to `windows` windows."""
    ids = [int(i) for i in ids]
    max_len = min(config.max_position_embeddings, len(ids))
    if max_len < 2:
        raise StemlmError("need at least 2 tokens of text to measure activated parameters")
    lengths = [n for n in (lengths or context_lengths(max_len)) if n <= max_len]
    rows = []
    for n in lengths:
        count = max(1, min(windows, len(ids) // n))
        stride = max(1, (len(ids) - n) // count) if count > 1 else 0
        starts = [k * stride for k in range(count)]
        uniq = [len(set(ids[s : s + n])) for s in starts]
        params = [activated_table_parameters(config, ids[s : s + n]) for s in starts]
        rows.append(
            {
                "context": n,
                "windows": count,
                "distinct_tokens": sum(uniq) / count,
                "activated_table_params": sum(params) / count,
            }
        )
    active = active_parameters(config)
    return {
        "projection_replaced_layers": len(config.special_layers) if get_kind(config.ffn).replaces_projection else 0,
        "d_ff": config.intermediate_size,
        "backbone_active_params": active["backbone"],
        "rows_per_token": active["rows"],
        "by_context": rows,
    }


def plot_activated(result: dict, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctx = [r["context"] for r in result["by_context"]]
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.plot(ctx, [r["activated_table_params"] for r in result["by_context"]], "o-", label="activated STEM rows")
    ax.axhline(result["backbone_active_params"], color="gray", ls="--", label="backbone active params")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("parameters")
    ax.legend(fontsize=8)
    ax.set_title("|S| x d_ff x distinct tokens", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
