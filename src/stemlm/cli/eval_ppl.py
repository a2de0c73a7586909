"""`stemlm eval ppl CKPT`: held-out loss, perplexity and bits per byte with a sliding window.

    stemlm eval ppl runs/tiny                                  # the embedded corpus's held-out split
    stemlm eval ppl runs/tiny --data notes.txt docs/ --seq-len 512 --stride 256 --json
    stemlm eval ppl runs/tiny --max-tokens 20000               # quick estimate over every document
    stemlm eval ppl runs/tiny --tables mmap --table-dtype int8 # e.g. a checkpoint from convert --table-dtype int8

Each document is scored on its own after `<|endoftext|>`; a long one is cut into windows of `--seq-len`
tokens (default: the window the run trained at, so the figure means what the training log's held-out loss
means) advancing by `--stride`, each token scored once (see `stemlm.evaluation.perplexity`). `--data`
files are scored whole (no split). This module adds the `ppl` subcommand to the `stemlm eval` group.
"""

from __future__ import annotations

import sys

from stemlm.cli.common import add_inference_flags, add_json_flag, print_json


def register_eval(subparsers) -> None:
    parser = subparsers.add_parser(
        "ppl",
        help="held-out loss, perplexity and bits per byte",
        description="Loss, perplexity and bits per byte of a checkpoint on held-out text, with a sliding window.",
    )
    parser.add_argument("checkpoint", metavar="CKPT", help="a checkpoint folder or a training run folder")
    parser.add_argument(
        "--data",
        nargs="+",
        metavar="PATH",
        help="text/markdown/jsonl files or folders to score whole (default: the embedded corpus held-out split)",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        metavar="L",
        help="window length in tokens (default: the window the run trained and evaluated at, from its "
        "trainer state; the model's maximum for a folder without one)",
    )
    parser.add_argument("--stride", type=int, metavar="S", help="tokens the window advances by, 1..L (default: L)")
    parser.add_argument("--max-tokens", type=int, metavar="N", help="score only about N tokens, spread over documents")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per forward (default: 8)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_inference_flags(parser)
    add_json_flag(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    from stemlm.evaluation.perplexity import perplexity_checkpoint, render_perplexity
    from stemlm.inference.load import InferenceOptions

    given = {k: getattr(args, k) for k in ("stride", "max_tokens", "batch_size")} | {"progress": not args.no_progress}
    report = perplexity_checkpoint(args.checkpoint, InferenceOptions.from_args(args), args.data, args.seq_len, **given)
    if args.json:
        print_json(report)
        return 0
    print(f"data: {report['data']}", file=sys.stderr)
    print(render_perplexity(report))
    return 0
