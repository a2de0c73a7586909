"""`stemlm convert`: import a GGUF model, or retrofit a dense model into a STEM one.

    stemlm convert --from-gguf SmolLM2-135M-Instruct.Q4_1.gguf --out ckpt/smollm2
    stemlm convert --from-dense ckpt/smollm2 --stem-layers 0 --out ckpt/smollm2-stem0
    stemlm convert --from-dense runs/tiny-dense --stem-layers odd --out ckpt/tiny-retrofit
    stemlm train --preset tiny --init-from ckpt/tiny-retrofit ...
    stemlm convert --to-llama runs/tiny-dense --out ckpt/tiny-llama      # model_type llama, for transformers
    stemlm convert runs/tiny --table-dtype int8 --out ckpt/tiny-int8     # lookup tables as row-wise int8
    stemlm convert --from-official dump/checkpoints/0000010000 --out ckpt/official   # the official trainer's

`--from-gguf` writes a Hugging Face Llama folder (dequantised fp32 weights, tokenizer, chat template; see
`stemlm.convert.gguf`). `--from-dense` takes a stemlm dense checkpoint, a run folder (its newest checkpoint) or
a local Hugging Face Llama folder; each selected layer's up-projection becomes the table E · W_upᵀ (see
`stemlm.convert.driver`); the tokenizer is copied. `--to-llama` writes a dense checkpoint with model_type "llama"
(`stemlm.convert.llama.save_as_llama`): a stemlm dense folder already loads into LlamaForCausalLM, but with a
model-type warning; this one loads silently. `CKPT --table-dtype bf16|int8` stores the lookup tables
compactly (`stemlm.convert.table_dtype`). `--from-official` reads a checkpoint of the official STEM trainer
(`stemlm.convert.official`). `--json` prints the output path and the new config.
"""

from __future__ import annotations

import sys

from stemlm.choices import COMPACT_TABLE_DTYPES, RETROFIT_INITS
from stemlm.cli.common import add_json_flag, print_json
from stemlm.errors import StemlmError

# The sources --stem-layers does not apply to, and why (the mutually exclusive group guarantees one source).
NOT_RETROFITS = {
    "ckpt": "CKPT --table-dtype keeps the model's layers",
    "to_llama": "--to-llama exports a dense model as it is",
    "from_official": "--from-official keeps the run's STEM layers",
    "from_gguf": "import the GGUF first, then retrofit it",
}


def run(args) -> int:
    source = next(name for name in (*NOT_RETROFITS, "from_dense") if getattr(args, name) is not None)
    if source != "ckpt" and args.table_dtype is not None:
        raise StemlmError("--table-dtype applies to a CKPT argument: stemlm convert CKPT --table-dtype int8 --out DIR")
    if source in NOT_RETROFITS and args.stem_layers is not None:
        raise StemlmError(f"--stem-layers applies to --from-dense; {NOT_RETROFITS[source]}")
    report, line = CONVERTERS[source](args)
    if args.json:
        print_json(report)
    else:
        print(line, file=sys.stderr)
    return 0


def _tables(args) -> tuple[dict, str]:
    from stemlm.convert.table_dtype import convert_tables

    if args.table_dtype is None:
        raise StemlmError("convert CKPT needs --table-dtype bf16 or int8 (the format to store the tables in)")
    out = convert_tables(args.ckpt, args.table_dtype, args.out, force=args.force)
    return {"out": str(out), "table_dtype": args.table_dtype}, f"wrote {out} with {args.table_dtype} lookup tables"


def _llama(args) -> tuple[dict, str]:
    from stemlm.convert.llama import export_llama

    out = export_llama(args.to_llama, args.out, force=args.force)
    return {"out": str(out), "model_type": "llama"}, f"wrote Hugging Face Llama folder {out} (model_type llama)"


def _gguf(args) -> tuple[dict, str]:
    from stemlm.convert.gguf import convert_gguf, summary

    options = dict(force=args.force, allow_nonfinite=args.allow_nonfinite, progress=not args.no_progress)
    out = convert_gguf(args.from_gguf, args.out, **options)
    return {"out": str(out), "config": summary(out)}, f"wrote Hugging Face Llama folder {out}"


def _stem(out) -> dict:
    from stemlm.checkpoint.folder import load_config

    config = load_config(out)
    return {"out": str(out), "stem_layers": config.special_layers, "config": config.to_dict()}


def _official(args) -> tuple[dict, str]:
    from stemlm.convert.official import convert_official

    report = _stem(convert_official(args.from_official, args.out, force=args.force))
    layers = report["stem_layers"]
    return report, f"wrote {report['out']} from the official checkpoint (STEM layers {layers}; no tokenizer)"


def _dense(args) -> tuple[dict, str]:
    from stemlm.convert.driver import convert_checkpoint

    if args.stem_layers is None:
        raise StemlmError("--from-dense needs --stem-layers (e.g. 0, odd, 1,3,5)")
    retrofit = {k: getattr(args, k) for k in ("init", "calibration", "calibration_tokens")}
    retrofit |= {"adapter": args.retrofit == "adapter", "progress": not args.no_progress}
    out = convert_checkpoint(args.from_dense, args.stem_layers, args.out, force=args.force, **retrofit)
    report = _stem(out)
    return report, f"wrote STEM checkpoint {report['out']} (tables in layers {report['stem_layers']})"


CONVERTERS = {"ckpt": _tables, "to_llama": _llama, "from_official": _official, "from_gguf": _gguf, "from_dense": _dense}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "convert",
        help="import a GGUF model, retrofit a dense checkpoint into STEM, or export a dense one as Llama",
        description="Import a Llama GGUF file as a Hugging Face Llama folder (--from-gguf), or retrofit a dense "
        "checkpoint (stemlm or local HF Llama) into STEM with tables U_l = E · W_up_lᵀ (--from-dense).",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "ckpt",
        nargs="?",
        metavar="CKPT",
        help="a stemlm checkpoint or run folder whose lookup tables --table-dtype stores compactly",
    )
    source.add_argument(
        "--from-dense",
        metavar="CKPT",
        help="dense stemlm checkpoint or run folder, or a local Hugging Face Llama folder",
    )
    source.add_argument("--from-gguf", metavar="FILE", help="a Llama-architecture GGUF file (llama.cpp format)")
    source.add_argument(
        "--from-official",
        metavar="DIR",
        help="a checkpoint of the official STEM trainer: a step folder (DCP + stem_shards/) or its consolidated/ "
        "folder (stemlm.convert.official)",
    )
    source.add_argument(
        "--to-llama",
        metavar="CKPT",
        help="export a dense stemlm checkpoint or run folder as a Hugging Face Llama folder (model_type llama), "
        "which transformers' LlamaForCausalLM loads without a warning",
    )
    p.add_argument(
        "--stem-layers",
        metavar="SPEC",
        help="(--from-dense) layers to turn into STEM layers: all, all-but-first, odd, even, half, every:K or 1,3,5",
    )
    p.add_argument(
        "--retrofit",
        choices=("table", "adapter"),
        default="table",
        help="(--from-dense) table: U replaces W_up (default); adapter: W_up x and U[t] blended per channel by a "
        "learned gate starting near 0 (ffn stem_adapter, the official code's adapter variant)",
    )
    p.add_argument(
        "--init",
        choices=RETROFIT_INITS,
        default="embed",
        help="(--from-dense) table start: embed = E·W_upᵀ (default), normed = W_up·RMSNorm_l(E[t]), calib = mean "
        "W_up·h_l over each token's occurrences in calibration text (normed for unseen tokens); "
        "see stemlm.convert.retrofit",
    )
    p.add_argument(
        "--calibration",
        nargs="+",
        metavar="PATH",
        help="(--init calib) text/jsonl files or folders (default: the embedded corpus train split)",
    )
    p.add_argument(
        "--calibration-tokens",
        type=int,
        default=32768,
        metavar="N",
        help="(--init calib) calibration tokens to run through the dense model (default 32768)",
    )
    p.add_argument(
        "--table-dtype",
        choices=COMPACT_TABLE_DTYPES,
        help="(CKPT) store every lookup table as bf16, or int8 codes with one fp32 scale per row (row-wise "
        "quantisation); every command loads the result, --tables host/mmap keep the rows compact",
    )
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="(--from-gguf) import weights holding NaN or Inf (refused by default: such a model computes NaN)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write the converted model to")
    p.add_argument(
        "--force", action="store_true", help="replace --out if it holds an earlier convert output (never anything else)"
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="(--from-dense, --from-gguf) no progress bar on stderr (one step per stage, or per GGUF tensor)",
    )
    add_json_flag(p)
    p.set_defaults(func=run)
