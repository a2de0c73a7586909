"""The hot-row cache on real text: replay a token stream through each policy and size, write the hit-rate curve.

`cache_sim_report(...)` is `stemlm cache-sim`: the tokenizer and vocabulary size come from a checkpoint (or a
named tokenizer), the texts are tokenized and joined with <|endoftext|> (`token_stream`) and replayed one token
per step, as in decoding (`simulate`, through `stemlm.offload.cache.replay_grid`). Each cache size is a fraction of the
vocabulary; `static_top` is the hit rate of the best fixed cache in hindsight (the stream's own most frequent
ids). A warm start seeds the cache with token counts of other text, which weigh like replayed tokens. With a
checkpoint of an n-gram kind, the n-gram row cache is simulated too (`stemlm.offload.ngram_sim`).
`write_cache_sim` writes the JSON and the PNG (`plot_hit_rates`) atomically, `render_hit_rates` is the table the
command prints, and `parse_fractions` / `parse_policies` read the sizes and policies as typed.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from stemlm.choices import CACHE_POLICIES
from stemlm.errors import StemlmError

JSON_NAME, PNG_NAME = "cache_sim.json", "cache_sim.png"


def replay_tokenizer(ckpt: str | None, tokenizer: str | None):
    """(tokenizer, vocabulary size, tokenizer name): CKPT's (or `tokenizer`, checked to fit CKPT's vocabulary),
    else the named tokenizer ("default" when none is named)."""
    from stemlm.checkpoint.folder import TOKENIZER_NAME, load_config
    from stemlm.checkpoint.runs import resolve_checkpoint
    from stemlm.data.tokenizer import get_tokenizer

    if ckpt is None:
        tok = get_tokenizer(tokenizer or "default")
        return tok, tok.get_vocab_size(), tokenizer or "default"
    folder = resolve_checkpoint(ckpt)
    vocab = load_config(folder).vocab_size
    if tokenizer is None and not (folder / TOKENIZER_NAME).is_file():
        raise StemlmError(f"checkpoint {folder} has no {TOKENIZER_NAME}; name one with --tokenizer")
    name = tokenizer or str(folder)
    tok = get_tokenizer(name)
    if tok.get_vocab_size() > vocab:
        raise StemlmError(f"tokenizer {name} has {tok.get_vocab_size()} tokens, more than the model's {vocab}")
    return tok, vocab, name


def parse_fractions(text: str) -> list[float]:
    """Cache sizes typed as fractions of the vocabulary ("0.01,0.1"), each in [0, 1]."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise StemlmError(f"--fractions {text!r} is not a comma-separated list of numbers") from None
    if not values or any(not 0 <= v <= 1 for v in values):
        raise StemlmError(f"--fractions {text!r}: give fractions of the vocabulary between 0 and 1")
    return values


def parse_policies(text: str) -> list[str]:
    """Replacement policies typed as a comma list ("lfu,lru"), each one of `stemlm.choices.CACHE_POLICIES`."""

    names = [x.strip().lower() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in CACHE_POLICIES]
    if not names or bad:
        raise StemlmError(f"--policy {text!r}: choose from {', '.join(CACHE_POLICIES)} (comma-separated)")
    return names


def token_stream(tok, texts: list[str]) -> list[int]:
    """Every text's ids followed by <|endoftext|> (when the tokenizer has it), as one stream."""
    eot = tok.token_to_id("<|endoftext|>")
    stream: list[int] = []
    for encoding in tok.encode_batch(texts):
        stream += encoding.ids + ([eot] if eot is not None else [])
    return stream


def simulate(stream, vocab, fractions, policies, warm_counts=None, on_replay=None) -> dict:
    """Hits, misses and evictions of each (policy, fraction of `vocab`), and the best static cache's hit rate.
    `on_replay`: called after each replay (`stemlm.offload.cache.replay_grid`)."""
    from stemlm.offload.cache import replay_grid, resolve_capacity

    counts = Counter(stream)
    ranked = sorted(counts.values(), reverse=True)
    static = []
    for fraction in fractions:
        capacity = resolve_capacity(vocab, fraction=fraction)
        static.append({"fraction": fraction, "capacity": capacity, "hit_rate": sum(ranked[:capacity]) / len(stream)})
    fields = ("hits", "misses", "evictions")
    results = replay_grid(stream, vocab, fractions, policies, fields, warm_counts, on_replay=on_replay)
    return {"tokens": len(stream), "distinct_tokens": len(counts), "results": results, "static_top": static}


def cache_sim_report(
    ckpt: str | None,
    tokenizer: str | None,
    data: list[str] | None,
    warm: list[str] | None,
    fractions: list[float],
    policies: list[str],
    max_tokens: int | None = None,
    log: Callable[[str], None] = lambda message: None,
    progress: bool = False,
) -> dict:
    """The replay of `data` (default: the embedded corpus's held-out split), warm-started from the token counts
    of `warm` when given ([]: the embedded corpus's train split); the dict `stemlm cache-sim --json` prints.
    `progress`: a bar on stderr, one step per replayed (policy, size) (`stemlm.progress`)."""
    from stemlm.checkpoint.folder import load_config
    from stemlm.checkpoint.runs import resolve_checkpoint
    from stemlm.data.corpus import embedded_texts
    from stemlm.data.sources import read_texts
    from stemlm.model.ngram import ngram_hasher
    from stemlm.offload.ngram_sim import simulate_ngram
    from stemlm.progress import bar as progress_bar

    tok, vocab, tok_name = replay_tokenizer(ckpt, tokenizer)
    start = time.perf_counter()
    stream = token_stream(tok, read_texts(data) if data else embedded_texts("heldout"))
    stream = stream[:max_tokens]
    if not stream:
        raise StemlmError("the data encodes to no tokens")
    warm_counts = None
    if warm is not None:
        counts = Counter(token_stream(tok, read_texts(warm) if warm else embedded_texts("train")))
        warm_counts = [counts.get(t, 0) for t in range(vocab)]
    log(f"cache-sim: replaying {len(stream):,} tokens (V={vocab:,}) ...")
    # n-gram kinds: the n-gram row cache is replayed too (fractions of its rows, no warm start)
    config = load_config(resolve_checkpoint(ckpt)) if ckpt is not None else None
    grids = 2 if config is not None and ngram_hasher(config) is not None else 1
    replays = grids * len(fractions) * len(policies)
    with progress_bar(replays, progress=progress, desc="cache-sim", unit="replay") as bar:

        def replayed(row: dict) -> None:
            bar.set_postfix_str(f"{row['policy']} {row['fraction']:g}", refresh=False)
            bar.update()

        report = {
            "tokenizer": tok_name,
            "vocab_size": vocab,
            "data": data or "embedded corpus, held-out split",
            "warm": None if warm is None else (warm or "embedded corpus, train split"),
            **simulate(stream, vocab, fractions, policies, warm_counts, replayed),
        }
        ngram = simulate_ngram(config, stream, fractions, policies, replayed) if grids == 2 else None
    if ngram is not None:
        report["ngram"] = ngram
    report["seconds"] = time.perf_counter() - start
    return report


def render_hit_rates(report: dict) -> str:
    """The table `stemlm cache-sim` prints: a row per policy and size, the static reference, the n-gram cache."""
    row = "{:<8}{:>9g}{:>8}{:>9.1f}%"
    lines = [
        f"{report['tokens']:,} tokens, {report['distinct_tokens']:,} distinct, vocabulary {report['vocab_size']:,}",
        f"{'policy':<8}{'fraction':>9}{'rows':>8}{'hit rate':>10}",
    ]
    lines += [row.format(r["policy"], r["fraction"], r["capacity"], 100 * r["hit_rate"]) for r in report["results"]]
    lines += [row.format("static", r["fraction"], r["capacity"], 100 * r["hit_rate"]) for r in report["static_top"]]
    if "ngram" in report:
        ng = report["ngram"]
        lines.append(
            f"n-gram rows: {ng['rows']:,}, {ng['keys_per_token']} ids per token, {ng['distinct_ids']:,} distinct"
        )
        lines += [row.format(r["policy"], r["fraction"], r["capacity"], 100 * r["hit_rate"]) for r in ng["results"]]
    return "\n".join(lines)


def write_cache_sim(report: dict, out: Path, **guard) -> None:
    """`out`/cache_sim.json and cache_sim.png, written atomically (`guard`: `AtomicFolder`'s refusal rules)."""
    from stemlm.checkpoint.folder import write_json
    from stemlm.checkpoint.safe_write import AtomicFolder

    with AtomicFolder(out, **guard) as tmp:
        write_json(tmp / JSON_NAME, report)
        plot_hit_rates(report, tmp / PNG_NAME)


def plot_hit_rates(report: dict, path: Path) -> None:
    """Hit rate against cache size, one line per policy and the best static cache dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in dict.fromkeys(r["policy"] for r in report["results"]):
        rows = [r for r in report["results"] if r["policy"] == policy]
        ax.plot([100 * r["fraction"] for r in rows], [100 * r["hit_rate"] for r in rows], "o-", label=policy.upper())
    ax.plot(
        [100 * r["fraction"] for r in report["static_top"]],
        [100 * r["hit_rate"] for r in report["static_top"]],
        "k--",
        label="best static (hindsight)",
    )
    ax.set_xlabel("cache size (% of vocabulary rows)")
    ax.set_ylabel("hit rate (%)")
    ax.set_title(f"STEM row cache, {report['tokens']:,} tokens, V={report['vocab_size']:,}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
