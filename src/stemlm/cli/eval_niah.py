"""`stemlm eval niah CKPT` (needle-in-a-haystack grid) and `stemlm eval niah-data` (passkey training data).

    stemlm eval niah runs/tiny --lengths 256,512,1024 --depths 0,0.25,0.5,0.75,1 --samples 4 --out niah/
    stemlm eval niah runs/tiny --lengths 256 --depths 0.5 --needles 4 --digits 4 --json
    stemlm eval niah-data --out niah_train.jsonl --num 2000 --lengths 192,256   # then train with --data

`niah` writes `niah.json` (accuracy per cell, per length, overall) and `niah_heatmap.png` into `--out`
(default: the run folder's `eval-niah/`);
lengths above the model's max_position_embeddings are refused. `niah-data` writes {"text": ...} jsonl
documents (needle sample + answer) that a small model needs in its training mix to learn retrieval at all.
This module adds both subcommands to the `stemlm eval` group (one registration function each).
"""

from __future__ import annotations

import sys
from pathlib import Path

from stemlm.cli.common import add_inference_flags, add_json_flag, arg_type, print_json
from stemlm.errors import StemlmError
from stemlm.evaluation.niah import depth_fractions, positive_ints


def register_eval(subparsers) -> None:
    parser = subparsers.add_parser(
        "niah",
        help="needle-in-a-haystack accuracy grid and heatmap",
        description="RULER-style needle-in-a-haystack: accuracy over context lengths x needle depths.",
    )
    parser.add_argument("checkpoint", metavar="CKPT", help="a checkpoint folder or a training run folder")
    parser.add_argument(
        "--lengths",
        type=arg_type(positive_ints),
        default=[256, 512, 1024],
        help="context lengths in tokens (default: 256,512,1024)",
    )
    parser.add_argument(
        "--depths",
        type=arg_type(depth_fractions),
        default=[0.0, 0.25, 0.5, 0.75, 1.0],
        help="needle depths in [0, 1] (default: 0,0.25,0.5,0.75,1)",
    )
    parser.add_argument("--samples", type=int, default=4, help="samples per (length, depth) cell (default: 4)")
    parser.add_argument(
        "--needles", type=int, default=1, help="needles per haystack; >1 is the multi-key variant (default: 1)"
    )
    parser.add_argument("--digits", type=int, default=7, help="digits of each magic number (default: 7)")
    parser.add_argument("--seed", type=int, default=0, help="seed of keys, numbers and distractor positions")
    add_inference_flags(parser)
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="folder for niah.json and niah_heatmap.png (default: RUN/eval-niah, beside the checkpoint)",
    )
    parser.add_argument("--force", action="store_true", help="replace --out if it holds an earlier niah output")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_json_flag(parser)
    parser.set_defaults(func=run)


def register_eval_data(subparsers) -> None:
    data = subparsers.add_parser(
        "niah-data",
        help="write passkey-retrieval training documents (jsonl)",
        description="Synthetic needle-in-a-haystack training documents (prompt + answer) as jsonl for --data.",
    )
    data.add_argument("--out", required=True, metavar="FILE", help="the jsonl file to write")
    data.add_argument("--force", action="store_true", help="replace --out FILE if it exists")
    data.add_argument("--num", type=int, default=1000, help="number of documents (default: 1000)")
    data.add_argument(
        "--lengths",
        type=arg_type(positive_ints),
        default=[192, 256],
        help="document lengths in tokens to draw from; each must hold the largest --needles (default: 192,256)",
    )
    data.add_argument(
        "--needles", type=arg_type(positive_ints), default=[1, 2, 4], help="needle counts to draw from (default: 1,2,4)"
    )
    data.add_argument("--digits", type=int, default=7, help="digits of each magic number (default: 7)")
    data.add_argument("--seed", type=int, default=1234, help="seed (default 1234, distinct from evaluation seeds)")
    data.add_argument(
        "--tokenizer", default="default", help="tokenizer that lengths are measured in (default: default)"
    )
    data.set_defaults(func=run_data)


def run(args) -> int:
    from stemlm.checkpoint.runs import checked_output
    from stemlm.evaluation.niah import niah_checkpoint, render_niah, write_niah
    from stemlm.inference.load import InferenceOptions

    out, guard = checked_output(args.out, args.checkpoint, "eval-niah", "stemlm eval niah", args.force)
    given = {k: getattr(args, k) for k in ("samples", "needles", "digits", "seed")} | {"progress": not args.no_progress}
    result = niah_checkpoint(args.checkpoint, InferenceOptions.from_args(args), args.lengths, args.depths, **given)
    write_niah(result, out, f"{result['variant']}: {Path(args.checkpoint).name}", **guard)
    if args.json:
        print_json({k: v for k, v in result.items() if k != "outputs"} | {"out": str(out)})
        return 0
    print(render_niah(result))
    print(f"wrote {out / 'niah.json'} and {out / 'niah_heatmap.png'}", file=sys.stderr)
    return 0


def run_data(args) -> int:
    from stemlm.data import get_tokenizer
    from stemlm.evaluation.niah import write_passkey_data

    if args.num < 1:
        raise StemlmError(f"--num must be positive, got {args.num}")
    kw = {k: getattr(args, k) for k in ("needles", "digits", "seed", "force")}
    path, count = write_passkey_data(get_tokenizer(args.tokenizer), args.out, args.num, args.lengths, **kw)
    print(f"wrote {count} documents to {path}", file=sys.stderr)
    return 0
