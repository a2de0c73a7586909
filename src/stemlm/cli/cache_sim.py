"""`stemlm cache-sim`: replay real text through the hot-row cache and write the hit-rate curve (JSON + PNG).

    stemlm cache-sim runs/tiny                 # embedded corpus, held-out split; writes runs/tiny/cache-sim/
    stemlm cache-sim --tokenizer default --fractions 0.01,0.05,0.1,0.2 --policy lfu,lru --out sim/
    stemlm cache-sim CKPT --data notes.txt --warm --json

The cache's behaviour depends only on the id stream, so only the tokenizer and the vocabulary size are
needed: from CKPT (a checkpoint or run folder) when given, else from `--tokenizer`. Documents are tokenized,
joined with <|endoftext|> and replayed one token per step, as in decoding. Each cache size is a fraction of
the vocabulary; `static_top` beside the curve is the hit rate of the best fixed cache in hindsight (the
stream's own most frequent ids), a reference point for the policies. `--warm` seeds the cache
with token counts of other text (the embedded corpus's train split by default); those counts weigh like
replayed tokens, so a large warm corpus turns LFU into a mostly static cache of that corpus's frequent ids.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

from stemlm.cli.common import add_json_flag, print_json
from stemlm.errors import StemlmError

DEFAULT_FRACTIONS = "0.01,0.05,0.1,0.2"
JSON_NAME, PNG_NAME = "cache_sim.json", "cache_sim.png"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "cache-sim",
        help="hit rate of the hot-row table cache on real text",
        description="Replay real text through the hot-row table cache and write the hit-rate curve (JSON + PNG).",
    )
    p.add_argument(
        "ckpt",
        nargs="?",
        metavar="CKPT",
        help="checkpoint or run folder whose tokenizer and vocab size to use (optional)",
    )
    p.add_argument(
        "--tokenizer", help="'default', 'gpt2' or a tokenizer.json / folder (default: CKPT's tokenizer, else 'default')"
    )
    p.add_argument(
        "--data",
        nargs="+",
        metavar="PATH",
        help="text/md/jsonl files or folders to replay (default: embedded corpus, held-out split)",
    )
    p.add_argument(
        "--fractions",
        default=DEFAULT_FRACTIONS,
        help=f"cache sizes as fractions of the vocabulary, comma-separated (default {DEFAULT_FRACTIONS})",
    )
    p.add_argument("--policy", default="lfu,lru", help="replacement policies to compare: lfu, lru or both (default)")
    p.add_argument(
        "--warm",
        nargs="*",
        metavar="PATH",
        help="warm-start from token counts of these files (no PATH: the embedded corpus's train split)",
    )
    p.add_argument("--max-tokens", type=int, help="replay only the first N tokens of the stream")
    p.add_argument(
        "--out",
        metavar="DIR",
        help=f"write {JSON_NAME} and {PNG_NAME} into DIR (default with CKPT: RUN/cache-sim beside the checkpoint; "
        "without CKPT nothing is written unless --out is given)",
    )
    p.add_argument("--force", action="store_true", help="replace --out if it holds an earlier cache-sim output")
    add_json_flag(p)
    p.set_defaults(func=run)


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise StemlmError(f"--fractions {text!r} is not a comma-separated list of numbers") from None
    if not values or any(not 0 <= v <= 1 for v in values):
        raise StemlmError(f"--fractions {text!r}: give fractions of the vocabulary between 0 and 1")
    return values


def _policies(text: str) -> list[str]:
    from stemlm.offload.cache import POLICIES

    names = [x.strip().lower() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in POLICIES]
    if not names or bad:
        raise StemlmError(f"--policy {text!r}: choose from {', '.join(POLICIES)} (comma-separated)")
    return names


def _tokenizer_and_vocab(args):
    from stemlm.checkpoint.folder import TOKENIZER_NAME, load_config
    from stemlm.checkpoint.runs import resolve_checkpoint
    from stemlm.data.tokenizer import get_tokenizer

    if args.ckpt is None:
        tok = get_tokenizer(args.tokenizer or "default")
        return tok, tok.get_vocab_size(), args.tokenizer or "default"
    folder = resolve_checkpoint(args.ckpt)
    vocab = load_config(folder).vocab_size
    if args.tokenizer is None and not (folder / TOKENIZER_NAME).is_file():
        raise StemlmError(f"checkpoint {folder} has no {TOKENIZER_NAME}; name one with --tokenizer")
    name = args.tokenizer or str(folder)
    tok = get_tokenizer(name)
    if tok.get_vocab_size() > vocab:
        raise StemlmError(f"tokenizer {name} has {tok.get_vocab_size()} tokens, more than the model's {vocab}")
    return tok, vocab, name


def token_stream(tok, texts: list[str]) -> list[int]:
    """Every text's ids followed by <|endoftext|> (when the tokenizer has it), as one stream."""
    eot = tok.token_to_id("<|endoftext|>")
    stream: list[int] = []
    for encoding in tok.encode_batch(texts):
        stream += encoding.ids + ([eot] if eot is not None else [])
    return stream


def simulate(stream, vocab, fractions, policies, warm_counts=None) -> dict:
    from stemlm.offload.cache import replay, resolve_capacity

    counts = Counter(stream)
    ranked = sorted(counts.values(), reverse=True)
    results, static = [], []
    for fraction in fractions:
        capacity = resolve_capacity(vocab, fraction=fraction)
        static.append({"fraction": fraction, "capacity": capacity, "hit_rate": sum(ranked[:capacity]) / len(stream)})
        for policy in policies:
            stats = replay(stream, vocab, capacity, policy, warm_counts)
            results.append(
                {
                    "policy": policy,
                    "fraction": fraction,
                    "capacity": capacity,
                    "hits": stats.hits,
                    "misses": stats.misses,
                    "evictions": stats.evictions,
                    "hit_rate": stats.hit_rate,
                }
            )
    return {"tokens": len(stream), "distinct_tokens": len(counts), "results": results, "static_top": static}


def plot(report: dict, path: Path) -> None:
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


def run(args) -> int:
    from stemlm.checkpoint.safe_write import AtomicFolder, check_target
    from stemlm.data.corpus import embedded_texts
    from stemlm.data.sources import read_texts

    out = Path(args.out) if args.out else None
    if out is None and args.ckpt is not None:
        from stemlm.checkpoint.runs import output_dir

        out = output_dir(args.ckpt, "cache-sim")
    guard = {"producer": "stemlm cache-sim", "force": args.force, "sources": [args.ckpt] if args.ckpt else []}
    if out is not None:
        check_target(out, **guard)  # before the replay
    fractions, policies = _floats(args.fractions), _policies(args.policy)
    if args.max_tokens is not None and args.max_tokens < 1:
        raise StemlmError("--max-tokens must be >= 1")
    tok, vocab, tok_name = _tokenizer_and_vocab(args)
    start = time.perf_counter()
    stream = token_stream(tok, read_texts(args.data) if args.data else embedded_texts("heldout"))
    stream = stream[: args.max_tokens]
    if not stream:
        raise StemlmError("the data encodes to no tokens")
    warm = None
    if args.warm is not None:
        counts = Counter(token_stream(tok, read_texts(args.warm) if args.warm else embedded_texts("train")))
        warm = [counts.get(t, 0) for t in range(vocab)]
    print(f"cache-sim: replaying {len(stream):,} tokens (V={vocab:,}) ...", file=sys.stderr)
    report = {
        "tokenizer": tok_name,
        "vocab_size": vocab,
        "data": args.data or "embedded corpus, held-out split",
        "warm": None if args.warm is None else (args.warm or "embedded corpus, train split"),
        **simulate(stream, vocab, fractions, policies, warm),
    }
    if args.ckpt is not None:  # n-gram kinds: the n-gram row cache too (fractions of its rows, no warm start)
        from stemlm.checkpoint.folder import load_config
        from stemlm.checkpoint.runs import resolve_checkpoint
        from stemlm.offload.ngram_sim import simulate_ngram

        ngram = simulate_ngram(load_config(resolve_checkpoint(args.ckpt)), stream, fractions, policies)
        if ngram is not None:
            report["ngram"] = ngram
    report["seconds"] = time.perf_counter() - start
    if out is not None:
        from stemlm.checkpoint.folder import write_json

        report["out"] = str(out)
        with AtomicFolder(out, **guard) as tmp:
            write_json(tmp / JSON_NAME, report)
            plot(report, tmp / PNG_NAME)
    if args.json:
        print_json(report)
        return 0
    print(f"{report['tokens']:,} tokens, {report['distinct_tokens']:,} distinct, vocabulary {vocab:,}")
    print(f"{'policy':<8}{'fraction':>9}{'rows':>8}{'hit rate':>10}")
    for r in report["results"]:
        print(f"{r['policy']:<8}{r['fraction']:>9g}{r['capacity']:>8}{100 * r['hit_rate']:>9.1f}%")
    for r in report["static_top"]:
        print(f"{'static':<8}{r['fraction']:>9g}{r['capacity']:>8}{100 * r['hit_rate']:>9.1f}%")
    if "ngram" in report:
        ng = report["ngram"]
        print(f"n-gram rows: {ng['rows']:,}, {ng['keys_per_token']} ids per token, {ng['distinct_ids']:,} distinct")
        for r in ng["results"]:
            print(f"{r['policy']:<8}{r['fraction']:>9g}{r['capacity']:>8}{100 * r['hit_rate']:>9.1f}%")
    if out is not None:
        print(f"wrote {out / JSON_NAME} and {out / PNG_NAME}", file=sys.stderr)
    return 0
