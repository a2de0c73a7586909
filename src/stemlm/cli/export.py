"""`stemlm export RUN_OR_CKPT --out DIR`: a checkpoint's model as a plain model folder, offline, in one process.

    stemlm train --nproc 8 --parallel fsdp ... --out runs/big      # sharded checkpoints (each rank its pieces)
    stemlm export runs/big --out ckpt/big                          # config.json + model.safetensors + tokenizer
    stemlm export runs/big/checkpoints/step-002000 --out ckpt/big-2000 --json

A sharded checkpoint (stemlm.checkpoint.sharded) is first checked against its manifest, every file re-hashed,
then its pieces are assembled into full tensors on the CPU (no process group, no GPU, nothing unpickled) and
written as the model folder every CKPT command reads (the same format as a 1-process run's checkpoint, without
optimizer or trainer state). A plain checkpoint is verified the same way and re-written without its trainer
files. The output is written atomically and never replaces an existing folder unless `--force` and it is an
earlier `stemlm export` output. Memory: the whole model once, in fp32 as trained.
"""

from __future__ import annotations

import sys
from pathlib import Path

from stemlm.cli.common import add_json_flag, print_json
from stemlm.errors import StemlmError

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
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from stemlm.checkpoint.folder import save_pretrained
    from stemlm.checkpoint.runs import load_checkpoint, resolve_checkpoint
    from stemlm.checkpoint.safe_write import check_target, verify_folder
    from stemlm.checkpoint.sharded import is_sharded, sharded_metadata

    ckpt = resolve_checkpoint(args.ckpt)
    sources = (args.ckpt, ckpt)
    check_target(args.out, producer=EXPORT_PRODUCER, force=args.force, sources=sources)  # before any reading
    sharded = is_sharded(ckpt)
    if sharded:
        sharded_metadata(ckpt, verify=True)  # every file re-hashed against the manifest before anything is read
    elif Path(ckpt, "stemlm-manifest.json").is_file():
        result = verify_folder(ckpt)
        if not result["ok"]:
            bad = result["changed"] + result["missing"]
            raise StemlmError(f"{ckpt}: {len(bad)} files fail verification against its manifest: {', '.join(bad)}")
    model, tokenizer = load_checkpoint(ckpt)
    out = save_pretrained(model, args.out, tokenizer, force=args.force, sources=sources, producer=EXPORT_PRODUCER)
    summary = {
        "out": str(out),
        "source": str(ckpt),
        "sharded": sharded,
        "parameters": model.num_parameters(),
        "tokenizer": tokenizer is not None,
    }
    if args.json:
        print_json(summary)
    else:
        kind = "sharded checkpoint" if sharded else "checkpoint"
        print(f"wrote model folder {out} from {kind} {ckpt} ({summary['parameters']:,} parameters)", file=sys.stderr)
    return 0
