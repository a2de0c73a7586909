"""`stemlm analyze CKPT`: interpretability numbers (JSON) and PNGs for a STEM checkpoint.

    stemlm analyze runs/tiny --out analysis/ --prompt "The capital of France is" --token France
    stemlm analyze runs/tiny --dense runs/tiny-dense --only spread --json

Analyses (`--only`, default all): `spread` (pairwise cosines of STEM rows vs a dense checkpoint's W_up x, or
the model's own gate outputs without --dense), `attribution` (per position and STEM layer for the prompt's
predicted token), `nearest` (nearest tokens of --token by row cosine per layer), `activated` (activated
table parameters vs context length). Text comes from --text FILE or the embedded corpus's held-out split.
On a dense checkpoint the STEM-only analyses are skipped when not asked for by name.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from stemlm.cli.common import add_json_flag, print_json
from stemlm.errors import StemlmError

ANALYSES = ("spread", "attribution", "nearest", "activated")
STEM_ONLY = ("spread", "attribution")
DEFAULT_PROMPT = "The capital of France is"
TEXT_TOKENS = 4096  # tokens of held-out text read for spread and activated parameters


def _text_ids(args, tokenizer) -> list[int]:
    if args.text is not None:
        from stemlm.data.sources import read_texts

        text = "\n".join(read_texts([args.text]))  # one-line errors for a missing, binary or non-UTF-8 file
    else:
        from stemlm.data import embedded_texts

        text = "\n".join(embedded_texts("heldout"))[: TEXT_TOKENS * 8]
    ids = tokenizer.encode(text).ids[:TEXT_TOKENS]
    if len(ids) < 3:
        raise StemlmError("the analysis text encodes to fewer than 3 tokens; pass a longer --text")
    return ids


def _default_token(tokenizer, prompt_ids: list[int]) -> str:
    # The first word-like token of the prompt (>= 4 letters), e.g. " France" in "The capital of France is".
    for i in prompt_ids:
        piece = tokenizer.decode([i])
        if len(piece.strip()) >= 4 and piece.strip().isalpha():
            return piece
    return tokenizer.decode([prompt_ids[-1]])


def _chosen(args, model) -> list[str]:
    names = ANALYSES if args.only == "all" else [n.strip() for n in args.only.split(",") if n.strip()]
    for n in names:
        if n not in ANALYSES:
            raise StemlmError(f"unknown analysis {n!r}; choose from {', '.join(ANALYSES)} (comma list) or all")
    if not model.stem_tables():
        asked = [n for n in names if n in STEM_ONLY]
        if args.only != "all" and asked:
            raise StemlmError(f"{', '.join(asked)} need a STEM checkpoint; this one is dense (ffn=dense)")
        names = [n for n in names if n not in STEM_ONLY]
    return list(names)


def run(args) -> int:
    from stemlm.checkpoint.runs import load_checkpoint, output_dir
    from stemlm.checkpoint.safe_write import AtomicFolder, check_target

    if args.max_tokens is not None and args.max_tokens < 1:
        raise StemlmError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.top_k < 1:
        raise StemlmError(f"--top-k must be >= 1, got {args.top_k}")
    out = Path(args.out) if args.out else output_dir(args.ckpt, "analysis")
    guard = {"producer": "stemlm analyze", "force": args.force, "sources": [args.ckpt]}
    check_target(out, **guard)  # before any work
    model, tokenizer = load_checkpoint(args.ckpt, need_tokenizer="analysis")
    names = _chosen(args, model)
    prompt_ids = tokenizer.encode(args.prompt).ids
    if not prompt_ids:
        raise StemlmError("--prompt encodes to no tokens; pass some text")
    with AtomicFolder(out, **guard) as tmp:
        report = _analyze(args, model, tokenizer, names, prompt_ids, tmp, out)
    report["pngs"] = {name: str(out / Path(png).name) for name, png in report["pngs"].items()}
    if args.json:
        print_json(report)
    else:
        _print(report)
    return 0


def _analyze(args, model, tokenizer, names, prompt_ids, out: Path, final: Path) -> dict:
    """Every chosen analysis, its PNG written into `out` (the temporary folder of the atomic write to `final`).
    Inputs are read first, so a bad --text or --dense fails before the progress bar (one bar step per analysis)."""
    from tqdm import tqdm

    from stemlm.analysis import activated, attribution, nearest, spread
    from stemlm.checkpoint.runs import load_checkpoint

    report: dict = {"checkpoint": args.ckpt, "prompt": args.prompt, "out": str(final), "pngs": {}}
    if "spread" in names or "activated" in names:
        text_ids = _text_ids(args, tokenizer)
    dense = load_checkpoint(args.dense)[0] if args.dense and "spread" in names else None
    with tqdm(total=len(names), desc="analyze", unit="analysis", file=sys.stderr, disable=args.no_progress) as bar:
        if "spread" in names:
            bar.set_postfix_str("spread")
            result, samples = spread.angular_spread(model, text_ids, dense=dense, max_tokens=args.max_tokens)
            report["spread"] = result
            name = "dense W_up x" if dense is not None else "own gate_proj(x)"
            report["pngs"]["spread"] = str(spread.plot_spread(samples, name, out / "spread.png"))
            bar.update()
        if "attribution" in names:
            bar.set_postfix_str("attribution")
            target = None
            if args.predict is not None:
                target = nearest.query_token(tokenizer, args.predict, model.config.vocab_size)
            result = attribution.attribute(model, prompt_ids, target)
            report["attribution"] = {**result, "prompt": args.prompt, "token": tokenizer.decode([result["token_id"]])}
            labels = [tokenizer.decode([i]) for i in prompt_ids]
            png = attribution.plot_attribution(result, labels, report["attribution"]["token"], out / "attribution.png")
            report["pngs"]["attribution"] = str(png)
            bar.update()
        if "nearest" in names:
            bar.set_postfix_str("nearest")
            token = args.token or _default_token(tokenizer, prompt_ids)
            report["nearest"] = nearest.nearest_tokens(model, tokenizer, token, args.top_k)
            report["pngs"]["nearest"] = str(nearest.plot_nearest(report["nearest"], out / "nearest.png"))
            bar.update()
        if "activated" in names:
            bar.set_postfix_str("activated")
            report["activated"] = activated.activated_vs_context(model.config, text_ids)
            report["pngs"]["activated"] = str(activated.plot_activated(report["activated"], out / "activated.png"))
            bar.update()
    pngs = {name: str(final / Path(png).name) for name, png in report["pngs"].items()}
    (out / "analysis.json").write_text(json.dumps({**report, "pngs": pngs}, indent=2) + "\n")
    return report


def _print(report: dict) -> None:
    print(f"prompt: {report['prompt']!r}")
    if "spread" in report:
        print(f"angular spread over {report['spread']['tokens']} tokens (baseline: {report['spread']['baseline']}):")
        for layer, r in report["spread"]["layers"].items():
            s, b = r["stem_rows"], r["baseline"]
            print(
                f"  layer {layer}: mean cos STEM rows {s['mean']:+.3f} (|cos| {s['mean_abs']:.3f})"
                f"  vs baseline {b['mean']:+.3f} (|cos| {b['mean_abs']:.3f})"
            )
    if "attribution" in report:
        a = report["attribution"]
        print(f"attribution for {a['token']!r} (log p {a['logprob']:.3f}):")
        for layer, r in a["layers"].items():
            top = max(range(len(r["grad_x_input"])), key=lambda i: abs(r["grad_x_input"][i]))
            print(f"  layer {layer}: strongest grad x input at position {top} ({r['grad_x_input'][top]:+.4f})")
    if "nearest" in report:
        n = report["nearest"]
        print(f"nearest tokens to {n['query']!r}:")
        for table, rows in n["tables"].items():
            print(f"  {table}: " + ", ".join(f"{r['token']!r} {r['cosine']:.2f}" for r in rows[:5]))
    if "activated" in report:
        print("activated STEM parameters by context length:")
        for r in report["activated"]["by_context"]:
            print(
                f"  {r['context']:>6} tokens: {r['distinct_tokens']:.0f} distinct -> "
                f"{r['activated_table_params']:,.0f} table params"
            )
    print(f"wrote {', '.join(report['pngs'].values()) or 'no plots'} and analysis.json", file=sys.stderr)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "analyze",
        help="interpretability: angular spread, attribution, nearest tokens, ...",
        description="Interpretability analyses of STEM micro-experts, as JSON numbers and PNGs.",
    )
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint folder, or run folder (uses its newest checkpoint)")
    p.add_argument(
        "--prompt",
        default=DEFAULT_PROMPT,
        help=f"prompt for attribution (and --token default); default {DEFAULT_PROMPT!r}",
    )
    p.add_argument("--predict", help="token whose log-prob is attributed (default: the model's top next token)")
    p.add_argument("--token", help="query token for nearest tokens (default: the prompt's first word token)")
    p.add_argument("--top-k", type=int, default=10, help="nearest tokens listed per table (default 10)")
    p.add_argument("--dense", metavar="CKPT", help="dense checkpoint whose W_up x is the angular-spread baseline")
    p.add_argument("--text", metavar="FILE", help="text file for spread / activated (default: held-out corpus)")
    p.add_argument("--max-tokens", type=int, default=512, help="distinct tokens compared in the spread (default 512)")
    p.add_argument("--only", default="all", help=f"comma list of analyses: {', '.join(ANALYSES)} (default all)")
    p.add_argument("--out", help="folder for analysis.json and the PNGs (default: RUN/analysis, beside the checkpoint)")
    p.add_argument("--force", action="store_true", help="replace --out if it holds an earlier analyze output")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_json_flag(p)
    p.set_defaults(func=run)
