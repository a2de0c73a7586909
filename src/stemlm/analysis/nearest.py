"""Nearest tokens of a query token by cosine similarity of STEM rows, per layer (and of token embeddings).

If a STEM layer stores token-specific knowledge, the neighbours of " France" in its table say what the layer
groups it with (other countries? other capitalised words? nothing?). The token-embedding neighbours are
listed beside them as the reference every model has. `plot_nearest` draws one bar panel per table.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer

from stemlm.errors import StemlmError
from stemlm.model.decoder import StemLM
from stemlm.model.kinds.registry import key_label


def query_token(tokenizer: Tokenizer, text: str, vocab_size: int) -> int:
    """The single token id of `text` as a word inside a text (" France"), else exactly as written."""
    for candidate in (" " + text.strip(), text):
        ids = tokenizer.encode(candidate, add_special_tokens=False).ids
        if len(ids) == 1 and ids[0] < vocab_size:
            return ids[0]
    pieces = tokenizer.encode(" " + text.strip(), add_special_tokens=False).tokens
    raise StemlmError(f"{text!r} is not a single token of this tokenizer (it splits into {pieces}); pick one token")


@torch.no_grad()
def neighbours(weight: torch.Tensor, token_id: int, k: int) -> list[tuple[int, float]]:
    """The k rows most cosine-similar to row `token_id` (itself excluded), as (id, cosine)."""
    unit = torch.nn.functional.normalize(weight.float(), dim=-1)
    sims = unit @ unit[token_id]
    sims[token_id] = -float("inf")
    top = torch.topk(sims, min(k, len(sims) - 1))
    return [(int(i), float(v)) for v, i in zip(top.values, top.indices, strict=True)]


def nearest_tokens(model: StemLM, tokenizer: Tokenizer, token: str, k: int = 10) -> dict:
    """{table name: [{token, id, cosine}]} for every STEM layer and the token embedding."""
    token_id = query_token(tokenizer, token, model.config.vocab_size)
    named = {key_label(model.config, i): t.weight for i, t in sorted(model.token_tables().items())}
    named["embed_tokens"] = model.model.embed_tokens.weight
    tables = {
        name: [{"token": tokenizer.decode([i]), "id": i, "cosine": c} for i, c in neighbours(w, token_id, k)]
        for name, w in named.items()
    }
    return {"query": tokenizer.decode([token_id]), "query_id": token_id, "k": k, "tables": tables}


def plot_nearest(result: dict, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["tables"])
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 0.32 * result["k"] + 1.5), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        rows = result["tables"][name][::-1]
        ax.barh(range(len(rows)), [r["cosine"] for r in rows], color="tab:blue")
        ax.set_yticks(range(len(rows)), [repr(r["token"]) for r in rows], fontsize=8)
        ax.set_xlim(min(0.0, min((r["cosine"] for r in rows), default=0.0)), 1.0)
        ax.set_title(name, fontsize=9)
    fig.suptitle(f"nearest tokens to {result['query']!r} by row cosine", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
