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

import sys
from pathlib import Path

from stemlm.analysis.report import ANALYSES, DEFAULT_PROMPT
from stemlm.cli.common import add_json_flag, print_json
from stemlm.errors import StemlmError


def run(args) -> int:
    from stemlm.analysis.report import AnalysisOptions, chosen_analyses, render_analysis, run_analyses
    from stemlm.checkpoint.runs import checked_output, load_checkpoint
    from stemlm.checkpoint.safe_write import AtomicFolder

    if args.max_tokens is not None and args.max_tokens < 1:
        raise StemlmError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.top_k < 1:
        raise StemlmError(f"--top-k must be >= 1, got {args.top_k}")
    out, guard = checked_output(args.out, args.ckpt, "analysis", "stemlm analyze", args.force)  # before any work
    model, tokenizer = load_checkpoint(args.ckpt, need_tokenizer="analysis")
    options = AnalysisOptions.from_args(args)
    names = chosen_analyses(options, model)
    prompt_ids = tokenizer.encode(args.prompt).ids
    if not prompt_ids:
        raise StemlmError("--prompt encodes to no tokens; pass some text")
    with AtomicFolder(out, **guard) as tmp:
        report = run_analyses(options, model, tokenizer, names, prompt_ids, tmp, out)
    report["pngs"] = {name: str(out / Path(png).name) for name, png in report["pngs"].items()}
    if args.json:
        print_json(report)
    else:
        print(render_analysis(report))
        print(f"wrote {', '.join(report['pngs'].values()) or 'no plots'} and analysis.json", file=sys.stderr)
    return 0


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
