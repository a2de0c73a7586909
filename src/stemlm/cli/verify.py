"""`stemlm verify CKPT`: recompute the SHA-256 of every file a checkpoint's save recorded, report any change.

    stemlm verify runs/tiny                        # a run folder: its newest checkpoint
    stemlm verify runs/tiny/checkpoints/step-000150 --json

Every folder stemlm writes atomically carries `stemlm-manifest.json` (see `stemlm.checkpoint.safe_write`). Loading does
not hash (it stays fast), so damage inside tensor data, which loads as silent garbage, is found only here.
Exit 0 when every recorded file matches; otherwise one error line naming the damaged or missing files (exit 2).
"""

from __future__ import annotations

from stemlm.cli.common import add_json_flag, print_json


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "verify",
        help="check a checkpoint's files against the SHA-256 sums recorded at save",
        description="Recompute the SHA-256 of every file recorded in a checkpoint's stemlm-manifest.json.",
    )
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint folder, or run folder (checks its newest checkpoint)")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from stemlm.checkpoint.runs import verify_checkpoint

    result = verify_checkpoint(args.ckpt)
    if args.json:
        print_json(result)
    else:
        extra = f"; not recorded: {', '.join(result['unrecorded'])}" if result["unrecorded"] else ""
        print(f"{result['folder']}: all {result['files']} files match their recorded SHA-256{extra}")
    return 0
