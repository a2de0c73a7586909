"""`stemlm edit`: swap an entity's STEM rows for another's and show the output before and after.

    stemlm edit CKPT --prompt "Country: Spain. Capital:" --source Spain --target Germany --top-k 5
    stemlm edit CKPT --prompt "..." --source "United Kingdom" --target France --strategy left_pad --layers 1
    stemlm edit CKPT --source Spain --target Germany --save runs/edited          # global edit, new checkpoint
    stemlm edit CKPT --inject Zorbia --target France --save runs/zorbia --prompt "Country: Zorbia. Capital:"

Without --save/--inject the edit is positional: only the prompt's source span reads the target's rows, at
prefill, and generation continues from the KV cache. --save writes a global edit (every occurrence of the
source tokens, in the tables themselves) as a new checkpoint; it lists every token whose rows it changes and
the other words containing them, and refuses to save when there are such words unless
--allow-shared-subwords is given (" Spain" is "ĠSp" + "ain" in the shipped tokenizer, so " Britain" would
change too). --inject gives a new or rare token the target's rows. `stemlm eval edits` (registered from here
as `register_eval`) measures edits over many facts.
"""

from __future__ import annotations

import functools
import sys

from stemlm.choices import EDIT_MODES, EDIT_ROWS, edit_row_kind
from stemlm.cli.common import add_json_flag, print_json


def run(args) -> int:
    from stemlm.edit.session import EditOptions, load_for_edit, render_edit, run_edit, save_sources
    from stemlm.train.data import untrained_note

    options = EditOptions.from_args(args).checked()
    sources = save_sources(args.ckpt, args.save, args.force)
    model, tokenizer = load_for_edit(args.ckpt)
    report = run_edit(model, tokenizer, options, sources)
    # after the edit (a refused one stays one error line): rows of tokens the run never trained on
    note = untrained_note(args.ckpt, tokenizer, {"--target": args.target, "--source": args.source})
    if note:
        print(f"stemlm edit: warning: {note}", file=sys.stderr)
    if args.json:
        print_json(report)
        return 0
    print(render_edit(report))
    if "saved" in report:
        print(f"saved the edited checkpoint to {report['saved']}", file=sys.stderr)
    if "note" in report:
        print(f"note: {report['note']}", file=sys.stderr)
    return 0


def add_edit_flags(p, with_rows: bool = True) -> None:
    """Flags shared by `edit` and `eval edits`: strategy, padding, layers, row kind."""
    from stemlm.edit.spans import DEFAULT_PAD, GLOBAL_DEFAULT_PAD, PAD_ROWS, STRATEGIES

    p.add_argument(
        "--strategy",
        default="auto",
        choices=STRATEGIES,
        help="length-mismatch strategy (auto: one_to_one / copy / subset by the lengths)",
    )
    p.add_argument(
        "--pad",
        choices=PAD_ROWS,
        help=f"row at padded positions (left_pad / right_pad): the <|endoftext|> row, the source's own, or zeros "
        f"(default {DEFAULT_PAD} for positional edits, {GLOBAL_DEFAULT_PAD} for global ones)",
    )
    p.add_argument("--layers", help="STEM layers to edit: a comma list like 1,3, or all (default all)")
    if with_rows:
        p.add_argument(
            "--rows",
            type=edit_row_kind,
            choices=EDIT_ROWS,
            help="rows to swap: token-table rows, token-embedding rows, or both (default tables; both for "
            "--inject, since a new token's embedding row is untrained; 'stem' is the old name of tables)",
        )


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "edit",
        help="swap an entity's STEM rows for another's (positional, global, inject)",
        description="Knowledge editing by STEM row swapping; prints outputs before and after.",
    )
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint folder, or run folder (uses its newest checkpoint)")
    p.add_argument("--prompt", help='prompt text, e.g. "Country: Spain. Capital:" (needed for a positional edit)')
    p.add_argument("--source", help="the entity in the text whose rows are replaced, e.g. Spain")
    p.add_argument("--target", required=True, help="the entity whose rows are used instead, e.g. Germany")
    p.add_argument("--inject", metavar="TOKEN", help="give this new or rare token the target's rows (global)")
    p.add_argument("--save", metavar="OUT", help="apply the edit to the tables and save a new checkpoint at OUT")
    p.add_argument(
        "--force", action="store_true", help="let --save replace an earlier edit save there (never anything else)"
    )
    p.add_argument(
        "--allow-shared-subwords",
        action="store_true",
        help="with --save: save even when the source's tokens also occur in other words (which the edit then "
        "changes too; the output lists them)",
    )
    p.add_argument("--max-new-tokens", type=int, default=8, help="greedy tokens shown before/after (default 8)")
    p.add_argument("--top-k", type=int, default=5, help="next-token probabilities shown (default 5)")
    add_edit_flags(p)
    add_json_flag(p)
    p.set_defaults(func=run)


def run_eval(args) -> int:
    import json

    from stemlm.checkpoint.safe_write import write_output_file
    from stemlm.edit.eval_checks import check_edit_eval
    from stemlm.edit.evaluate import evaluate_checkpoint_edits
    from stemlm.edit.report import format_edit_table

    names = ("relation", "records", "countries", "seed", "variants", "layers", "dense", "strategy", "pad")
    names += ("fluency_tokens", "fluency_records", "out", "force")
    check_edit_eval(args.ckpt, **{k: getattr(args, k) for k in names})  # everything, before the (long) evaluation
    settings = {k: getattr(args, k) for k in ("strategy", "pad", "mode", "fluency_tokens", "fluency_records")}
    log = functools.partial(print, file=sys.stderr)
    given = {k: getattr(args, k) for k in ("seed", "layers", "variants", "dense", "countries")}
    each = [evaluate_checkpoint_edits(c, args.relation, args.records, log=log, **given, **settings) for c in args.ckpt]
    results = each[0] if len(each) == 1 else {"checkpoints": each, "paraphrase_moved": over_checkpoints(each)}
    if args.out:
        write_output_file(args.out, json.dumps(results, indent=2) + "\n", force=args.force)
    if args.json:
        print_json(results)
        return 0
    for one in each:
        print(*([f"{one['checkpoint']}:"] if len(each) > 1 else []), format_edit_table(one["variants"]), sep="\n")
    for variant, summary in results.get("paraphrase_moved", {}).items():
        print(f"paraphrases moved, {variant}: {_over_checkpoints_text(summary)}")
    return 0


def _over_checkpoints_text(summary: dict) -> str:
    def number(x):
        return "-" if x is None else f"{x:.3f}"

    lo, hi = summary["ci95"]
    return (
        f"mean {number(summary['mean'])}, 95% interval [{number(lo)}, {number(hi)}] over {summary['n']} checkpoints "
        f"knowing a paraphrase (each: {', '.join(map(number, summary['rates'])) or '-'})"
    )


def over_checkpoints(each: list[dict]) -> dict:
    """variant -> the paraphrase-moved rates of several checkpoints (seeds) with their mean and 95% t interval
    (stemlm.experiments.stats.mean_ci95, clipped to [0, 1]: a rate); checkpoints where the model knows no
    paraphrase are left out."""
    from stemlm.experiments.stats import mean_ci95

    out = {}
    for variant in each[0]["variants"]:
        rates = [r["variants"][variant]["paraphrase_moved"]["rate"] for r in each if variant in r["variants"]]
        rates = [r for r in rates if r is not None]
        summary = mean_ci95(rates)
        summary["ci95"] = [None if x is None else min(1.0, max(0.0, x)) for x in summary["ci95"]]
        out[variant] = {**summary, "rates": rates}
    return out


def register_eval(subparsers) -> None:
    """`stemlm eval edits`: registered into the `eval` command's sub-commands (see stemlm.cli.eval)."""
    p = subparsers.add_parser(
        "edits",
        help="edit metrics (training / held-out prompts, portability, locality) beside unedited values",
        description="Evaluate positional (or global) row-swap edits on CounterFact-style records of the fact "
        "world, for STEM rows, embedding rows and both: each figure beside its unedited value and chance level, "
        "over the records the model knows (their number is shown).",
    )
    p.add_argument(
        "ckpt",
        metavar="CKPT",
        nargs="+",
        help="checkpoint folder, or run folder (uses its newest checkpoint); several (one per seed): also the "
        "paraphrase-moved rate's mean and 95%% interval over them",
    )
    p.add_argument(
        "--countries",
        default="auto",
        help="subjects and targets of the records: all, a comma list of countries, or auto (the countries the "
        "run mixed into its training text; all for other checkpoints) (default auto)",
    )
    p.add_argument("--records", type=int, default=50, help="number of edit records (default 50; 0 = all)")
    p.add_argument("--relation", default="capital", help="fact relation: capital, language, currency or region")
    p.add_argument("--seed", type=int, default=0, help="seed that picks the records and their targets")
    p.add_argument(
        "--mode",
        default="positional",
        choices=EDIT_MODES,
        help="positional: edit the prompt's span; global: edit the source tokens everywhere",
    )
    p.add_argument(
        "--variants",
        default="auto",
        help="row kinds to evaluate, comma list of stem,embed,both (auto: all for STEM, embed for dense)",
    )
    p.add_argument("--dense", metavar="CKPT", help="also evaluate this dense checkpoint (embedding rows) as control")
    p.add_argument("--fluency-tokens", type=int, default=24, help="greedy tokens for the fluency entropy (0 = skip)")
    p.add_argument(
        "--fluency-records", type=int, default=10, help="records whose generations measure fluency (default 10)"
    )
    p.add_argument("--out", metavar="FILE", help="also write the results as JSON to FILE")
    p.add_argument("--force", action="store_true", help="replace --out FILE if it exists")
    add_edit_flags(p, with_rows=False)
    add_json_flag(p)
    p.set_defaults(func=run_eval)
