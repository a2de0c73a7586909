"""`stemlm export RUN_OR_CKPT --out DIR`: a checkpoint's model as a plain model folder, offline, in one process.

    stemlm train --nproc 8 --parallel fsdp ... --out runs/big      # sharded checkpoints (each rank its pieces)
    stemlm export runs/big --out ckpt/big                          # config.json + model.safetensors + tokenizer
    stemlm export runs/big/checkpoints/step-002000 --out ckpt/big-2000 --json
    stemlm export runs/big --out ckpt/big-hf --remote-code         # + modeling code: loads without stemlm

A sharded checkpoint (stemlm.checkpoint.sharded) is first checked against its manifest, every file re-hashed,
then its pieces are assembled into full tensors on the CPU (no process group, no GPU, nothing unpickled) and
written as the model folder every CKPT command reads (the same format as a 1-process run's checkpoint, without
optimizer or trainer state). A plain checkpoint is verified the same way and re-written without its trainer
files. The output is written atomically and never replaces an existing folder unless `--force` and it is an
earlier `stemlm export` output. Memory: the whole model once, in fp32 as trained.
"""

from __future__ import annotations

import sys

from stemlm.cli.common import add_json_flag, print_json

EXPORT_PRODUCER = "stemlm export"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "export",
        help="write a (sharded) training checkpoint as a plain model folder",
        description="Convert a training checkpoint (a sharded one from `stemlm train --nproc N`, or a 1-process "
        "one) into a model folder: config.json, model.safetensors, tokenizer.json. Runs in one process on the CPU.",
    )
    p.add_argument("ckpt", metavar="RUN_OR_CKPT", help="checkpoint folder, or run folder (its newest checkpoint)")
    p.add_argument("--out", required=True, help="the model folder to write (must not exist, unless --force)")
    p.add_argument("--force", action="store_true", help="replace an earlier `stemlm export` output at --out")
    p.add_argument(
        "--remote-code",
        action="store_true",
        help="make the folder load in transformers without stemlm: the modeling code and an auto_map for "
        "trust_remote_code=True (a dense model is written as a plain Llama folder instead)",
    )
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from stemlm.checkpoint.runs import export_model
    from stemlm.convert.llama import standalone_files

    extra = standalone_files if args.remote_code else None
    summary = export_model(args.ckpt, args.out, force=args.force, producer=EXPORT_PRODUCER, extra=extra)
    if args.json:
        print_json(summary)
    else:
        kind = "sharded checkpoint" if summary["sharded"] else "checkpoint"
        size = f"{summary['parameters']:,} parameters"
        print(f"wrote model folder {summary['out']} from {kind} {summary['source']} ({size})", file=sys.stderr)
    return 0
