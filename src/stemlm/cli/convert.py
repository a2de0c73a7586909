"""`stemlm convert --from-dense CKPT --stem-layers SPEC --out DIR`: retrofit a dense model into a STEM one.

    stemlm convert --from-dense runs/tiny-dense --stem-layers odd --out ckpt/tiny-retrofit
    stemlm train --preset tiny --init-from ckpt/tiny-retrofit ...

CKPT is a stemlm dense checkpoint, a run folder (its newest checkpoint) or a local Hugging Face Llama folder
(config.json with model_type "llama"). Each selected layer's up-projection becomes the table E · W_upᵀ (see
`stemlm.convert`); the tokenizer is copied. `--json` prints the output path and the new config.
"""

from __future__ import annotations

import sys

from stemlm.cli.common import add_json_flag, print_json


def run(args) -> int:
    from stemlm.checkpoint import load_config
    from stemlm.convert import convert_checkpoint

    out = convert_checkpoint(args.from_dense, args.stem_layers, args.out, force=args.force)
    config = load_config(out)
    if args.json:
        print_json({"out": str(out), "stem_layers": config.special_layers, "config": config.to_dict()})
    else:
        print(f"wrote STEM checkpoint {out} (tables in layers {config.special_layers})", file=sys.stderr)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "convert",
        help="retrofit a dense checkpoint into a STEM checkpoint",
        description="Retrofit a dense checkpoint (stemlm or local HF Llama) into STEM: tables U_l = E · W_up_lᵀ.",
    )
    p.add_argument(
        "--from-dense",
        required=True,
        metavar="CKPT",
        help="dense stemlm checkpoint or run folder, or a local Hugging Face Llama folder",
    )
    p.add_argument(
        "--stem-layers",
        required=True,
        metavar="SPEC",
        help="layers to turn into STEM layers: all, all-but-first, odd, even, half, every:K or 1,3,5",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write the STEM checkpoint to")
    p.add_argument("--force", action="store_true", help="overwrite --out if it already holds files")
    add_json_flag(p)
    p.set_defaults(func=run)
