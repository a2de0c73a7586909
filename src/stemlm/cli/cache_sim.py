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

import functools
import sys

from stemlm.cli.common import add_json_flag, print_json
from stemlm.errors import StemlmError
from stemlm.offload.cache_sim import JSON_NAME, PNG_NAME

DEFAULT_FRACTIONS = "0.01,0.05,0.1,0.2"


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
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr (one step per replay)")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from stemlm.checkpoint.runs import checked_output
    from stemlm.offload.cache_sim import (
        cache_sim_report,
        parse_fractions,
        parse_policies,
        render_hit_rates,
        write_cache_sim,
    )

    out, guard = checked_output(args.out, args.ckpt, "cache-sim", "stemlm cache-sim", args.force)  # before the replay
    fractions, policies = parse_fractions(args.fractions), parse_policies(args.policy)
    if args.max_tokens is not None and args.max_tokens < 1:
        raise StemlmError("--max-tokens must be >= 1")
    log = functools.partial(print, file=sys.stderr)
    sources = (args.ckpt, args.tokenizer, args.data, args.warm)
    report = cache_sim_report(*sources, fractions, policies, args.max_tokens, log, progress=not args.no_progress)
    if out is not None:
        report["out"] = str(out)
        write_cache_sim(report, out, **guard)
    if args.json:
        print_json(report)
        return 0
    print(render_hit_rates(report))
    if out is not None:
        print(f"wrote {out / JSON_NAME} and {out / PNG_NAME}", file=sys.stderr)
    return 0
