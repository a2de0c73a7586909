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

import sys

from stemlm.cli.common import add_json_flag, print_json
from stemlm.errors import StemlmError

EOT_TOKEN = "<|endoftext|>"
SHOWN_WORDS = 12  # words sharing a changed token, shown per token in text output


def load_for_edit(ckpt: str):
    from stemlm.checkpoint.runs import load_checkpoint

    return load_checkpoint(ckpt, need_tokenizer="editing (finding entity names)")


def _save_sources(args) -> tuple:
    """The folders --save must never replace (the CKPT argument and what it resolves to); checked before loading."""
    if args.save is None:
        return ()
    from stemlm.checkpoint.runs import resolve_checkpoint
    from stemlm.checkpoint.safe_write import check_target
    from stemlm.edit.table_edits import EDIT_PRODUCER

    sources = (args.ckpt, resolve_checkpoint(args.ckpt))
    check_target(args.save, producer=EDIT_PRODUCER, force=args.force, sources=sources, flag="--save")
    return sources


def parse_layers(spec: str | None, model) -> list[int] | None:
    from stemlm.model.config import resolve_layer_spec

    if spec is None or spec.strip().lower() == "all":
        return None
    return resolve_layer_spec(spec, model.config.num_hidden_layers)


def _view(model, tokenizer, prompt_ids, hooks, max_new_tokens: int, top_k: int) -> dict:
    """Greedy completion and the top-k next-token probabilities under `hooks` (applied at prefill)."""
    import torch

    from stemlm.edit.positional import greedy_generate

    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids]), rows=hooks[0], embed_rows=hooks[1]).logits[0, -1]
    probs = logits.float().softmax(-1)
    top = torch.topk(probs, min(top_k, probs.numel()))
    eos = tokenizer.token_to_id(EOT_TOKEN)
    ids = greedy_generate(model, prompt_ids, max_new_tokens, prefill=hooks, eos_id=eos)
    return {
        "completion": tokenizer.decode(ids),
        "top_k": [
            {"token": tokenizer.decode([int(i)]), "id": int(i), "prob": float(p)}
            for p, i in zip(top.values, top.indices, strict=True)
        ],
    }


def run(args) -> int:
    from stemlm.edit.positional import edit_hooks, edit_note, make_edit
    from stemlm.edit.shared_tokens import check_shared_subwords
    from stemlm.edit.spans import DEFAULT_PAD, GLOBAL_DEFAULT_PAD, check_distinct
    from stemlm.edit.table_edits import TableEditor

    if args.inject is None and args.source is None:
        raise StemlmError("pass --source ENTITY (the name in the text) or --inject TOKEN, with --target ENTITY")
    if args.inject is not None and args.source is not None:
        raise StemlmError("--inject and --source are exclusive: inject gives a token rows, --source edits a name")
    if args.top_k < 1 or args.max_new_tokens < 0:
        raise StemlmError(f"--top-k must be >= 1 and --max-new-tokens >= 0 (got {args.top_k}, {args.max_new_tokens})")
    positional = args.save is None and args.inject is None
    if positional and args.prompt is None:
        raise StemlmError('a positional edit needs --prompt, e.g. --prompt "Country: Spain. Capital:"')
    if args.source is not None:
        check_distinct(args.source, args.target)
    sources = _save_sources(args)
    model, tokenizer = load_for_edit(args.ckpt)
    layers = parse_layers(args.layers, model)
    args.rows = args.rows or ("both" if args.inject is not None else "stem")
    args.pad = args.pad or (DEFAULT_PAD if positional else GLOBAL_DEFAULT_PAD)
    report: dict = {
        "mode": "positional" if positional else "inject" if args.inject else "global",
        "target": args.target,
        "strategy": args.strategy,
        "pad": args.pad,
        "rows": args.rows,
    }
    prompt_ids = tokenizer.encode(args.prompt).ids if args.prompt is not None else None
    if prompt_ids is not None and not prompt_ids:
        raise StemlmError("the prompt encodes to no tokens; pass some text")
    if positional:
        edit = make_edit(
            model,
            tokenizer,
            prompt_ids,
            args.source,
            args.target,
            strategy=args.strategy,
            pad=args.pad,
            layers=layers,
            rows=args.rows,
        )
        report.update(source=args.source, positions=list(edit.positions), layers=list(edit.layers))
        before = _view(model, tokenizer, prompt_ids, (None, None), args.max_new_tokens, args.top_k)
        after = _view(model, tokenizer, prompt_ids, edit_hooks(model, edit), args.max_new_tokens, args.top_k)
    else:
        before = _maybe_view(model, tokenizer, prompt_ids, args)
        editor = TableEditor(model, tokenizer)
        if args.inject is not None:
            record = editor.inject(args.inject, args.target, strategy=args.strategy, layers=layers, rows=args.rows)
            prompt_ids = tokenizer.encode(args.prompt).ids if args.prompt is not None else None  # new token now
        else:
            record = editor.edit(
                args.source, args.target, strategy=args.strategy, pad=args.pad, layers=layers, rows=args.rows
            )
        report["edit"] = record.description
        after = _maybe_view(model, tokenizer, prompt_ids, args)
        if args.save is not None:
            check_shared_subwords(record.description, args.allow_shared_subwords)
            report["saved"] = str(editor.save(args.save, force=args.force, sources=sources))
    report.update(prompt=args.prompt, before=before, after=after)
    if edit_note(model):
        report["note"] = edit_note(model)
    if args.json:
        print_json(report)
    else:
        _print(report)
    return 0


def _maybe_view(model, tokenizer, prompt_ids, args) -> dict | None:
    if prompt_ids is None:
        return None
    return _view(model, tokenizer, prompt_ids, (None, None), args.max_new_tokens, args.top_k)


def _print(report: dict) -> None:
    what = report.get("source") or (report.get("edit") or {}).get("token") or (report.get("edit") or {}).get("source")
    print(f"{report['mode']} edit: {what!r} -> rows of {report['target']!r} ({report['rows']}, {report['strategy']})")
    for name in ("before", "after"):
        view = report[name]
        if view is None:
            continue
        print(f"{name:>6}: {report['prompt']}{view['completion']!r}")
        print("        " + "  ".join(f"{t['token']!r} {t['prob']:.3f}" for t in view["top_k"]))
    for token in (report.get("edit") or {}).get("changed_tokens", []):
        words = token["shared_with"]
        shown = ", ".join(words[:SHOWN_WORDS]) + (
            f", ... ({len(words)} in all; --json lists them)" if len(words) > SHOWN_WORDS else ""
        )
        print(f"rows changed: {token['token']!r} (id {token['id']}); also in: {shown or 'no other word'}")
    if "saved" in report:
        print(f"saved the edited checkpoint to {report['saved']}", file=sys.stderr)
    if "note" in report:
        print(f"note: {report['note']}", file=sys.stderr)


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
            choices=("stem", "embed", "both"),
            help="rows to swap: STEM table rows, token-embedding rows, or both (default stem; both for "
            "--inject, since a new token's embedding row is untrained)",
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


def _variants(spec: str, model) -> list[str]:
    if spec == "auto":
        return ["stem", "embed", "both"] if model.stem_tables() else ["embed"]
    variants = [v.strip() for v in spec.split(",") if v.strip()]
    for v in variants:
        if v not in ("stem", "embed", "both"):
            raise StemlmError(f"unknown variant {v!r} in --variants; use a comma list of stem, embed, both")
    return variants


def run_eval(args) -> int:
    import json

    from stemlm.checkpoint.safe_write import check_file_target, write_output_file
    from stemlm.data.worlds.facts import RELATIONS, edit_records
    from stemlm.edit.evaluate import evaluate_edits
    from stemlm.edit.report import format_edit_table

    if args.relation not in RELATIONS:
        raise StemlmError(f"unknown relation {args.relation!r}; choose one of {', '.join(RELATIONS)}")
    if args.records < 0:
        raise StemlmError(f"--records must be >= 0 (0 = all), got {args.records}")
    if args.out:
        check_file_target(args.out, force=args.force)  # before the (long) evaluation
    records = edit_records(args.relation, args.records or None, seed=args.seed)
    model, tokenizer = load_for_edit(args.ckpt)
    layers = parse_layers(args.layers, model)
    if args.fluency_records < 0:
        raise StemlmError(f"--fluency-records must be >= 0, got {args.fluency_records}")
    settings = dict(
        strategy=args.strategy,
        pad=args.pad,
        mode=args.mode,
        fluency_tokens=args.fluency_tokens,
        fluency_records=args.fluency_records,
    )
    results: dict = {"checkpoint": args.ckpt, "relation": args.relation, "seed": args.seed, "variants": {}}
    cache: dict = {}  # unedited scores and generations, shared by every variant of this model
    for variant in _variants(args.variants, model):
        print(f"evaluating {variant} rows on {len(records)} records ...", file=sys.stderr)
        chosen = layers if variant != "embed" else None
        results["variants"][variant] = evaluate_edits(
            model, tokenizer, records, rows=variant, layers=chosen, cache=cache, **settings
        )
    if args.dense is not None:
        print(f"evaluating the dense control {args.dense} (embedding rows) ...", file=sys.stderr)
        dense, dense_tok = load_for_edit(args.dense)
        results["variants"]["dense-embed"] = evaluate_edits(dense, dense_tok, records, rows="embed", **settings)
    if args.out:
        write_output_file(args.out, json.dumps(results, indent=2) + "\n", force=args.force)
    if args.json:
        print_json(results)
    else:
        print(format_edit_table(results["variants"]))
    return 0


def register_eval(subparsers) -> None:
    """`stemlm eval edits`: registered into the `eval` command's sub-commands (see stemlm.cli.eval)."""
    p = subparsers.add_parser(
        "edits",
        help="edit metrics (training / held-out prompts, portability, locality) beside unedited values",
        description="Evaluate positional (or global) row-swap edits on CounterFact-style records of the fact "
        "world, for STEM rows, embedding rows and both: each figure beside its unedited value and chance level, "
        "over the records the model knows (their number is shown).",
    )
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint folder, or run folder (uses its newest checkpoint)")
    p.add_argument("--records", type=int, default=50, help="number of edit records (default 50; 0 = all)")
    p.add_argument("--relation", default="capital", help="fact relation: capital, language, currency or region")
    p.add_argument("--seed", type=int, default=0, help="seed that picks the records and their targets")
    p.add_argument(
        "--mode",
        default="positional",
        choices=("positional", "global"),
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
