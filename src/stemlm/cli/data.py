"""`stemlm data`: tokenize a corpus once into memory-mapped shards that `stemlm train --data DIR` streams.

    stemlm data prepare corpus/ more.jsonl web.parquet --tokenizer gpt2 --out shards/ --workers 8
    stemlm data prepare notes/ --tokenizer llama3/tokenizer.json --separator "<|end_of_text|>" --out shards/
    stemlm data verify shards/                              # re-hash every shard against the manifest
    stemlm train --data shards/ --preset paper-350m --fit-vocab   # the folder's tokenizer is the run's

The format and the split rule are described in `stemlm.data.prepare`; reading in `stemlm.data.stream`. A file
given twice (or reached twice through folders or links) is tokenized once, with one warning line on stderr.
"""

from __future__ import annotations

import os
import sys
import time

from stemlm.cli.common import add_json_flag, print_json


def register(subparsers) -> None:
    parser = subparsers.add_parser("data", help="tokenize a corpus into memory-mapped token shards for training")
    commands = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)

    prep = commands.add_parser("prepare", help="tokenize text/jsonl/parquet files or folders into a shard folder")
    prep.add_argument("paths", nargs="+", metavar="PATH", help="files or folders (*.txt, *.md, *.jsonl, *.parquet)")
    prep.add_argument("--tokenizer", default="default", help="'default', 'gpt2' or a tokenizer.json / directory")
    prep.add_argument("--out", required=True, metavar="DIR", help="shard folder to create (must not exist)")
    prep.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes (default: all cores)"
    )
    prep.add_argument(
        "--separator", default="<|endoftext|>", help="special token after every document (default <|endoftext|>)"
    )
    prep.add_argument("--text-field", default="text", help="jsonl key / parquet column holding the text (default text)")
    prep.add_argument(
        "--heldout-fraction",
        type=float,
        default=0.01,
        help="share of documents (chosen by a hash of their text) in the held-out split (default 0.01)",
    )
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_json_flag(prep)
    prep.set_defaults(func=run_prepare)

    verify = commands.add_parser("verify", help="re-hash every shard of a prepared folder against its manifest")
    verify.add_argument("folder", metavar="DIR", help="a folder written by `stemlm data prepare`")
    verify.set_defaults(func=run_verify)


def run_prepare(args) -> int:
    from stemlm.data import get_tokenizer
    from stemlm.data.prepare import prepare, prepare_summary, render_prepare_summary

    start = time.perf_counter()
    manifest = prepare(
        args.paths,
        get_tokenizer(args.tokenizer),
        args.out,
        workers=args.workers,
        separator=args.separator,
        text_field=args.text_field,
        heldout_fraction=args.heldout_fraction,
        progress=not args.no_progress,
        warn=lambda message: print(f"stemlm data: warning: {message}", file=sys.stderr),
    )
    seconds = time.perf_counter() - start
    report = prepare_summary(manifest, args.out, seconds)
    if args.json:
        print_json(report)
    else:
        print(render_prepare_summary(report, seconds))
    return 0


def run_verify(args) -> int:
    from stemlm.data.manifest import read_manifest
    from stemlm.data.stream import verify_shards

    verify_shards(args.folder)
    shards = sum(len(s["shards"]) for s in read_manifest(args.folder)["splits"].values())
    print(f"{args.folder}: {shards} shards match the manifest")
    return 0
