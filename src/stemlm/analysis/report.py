"""`stemlm analyze` as a library: run the chosen analyses of a checkpoint, write the PNGs and analysis.json, render.

`AnalysisOptions` holds what the command takes (prompt, query tokens, the dense baseline, the text);
`chosen_analyses` resolves `--only` against the model; `run_analyses` runs `spread`, `attribution`, `nearest`
and `activated` (the modules of this package) into one JSON-ready report; `render_analysis` is its text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from stemlm.errors import StemlmError

ANALYSES = ("spread", "attribution", "nearest", "activated")
STEM_ONLY = ("spread", "attribution")
DEFAULT_PROMPT = "The capital of France is"
TEXT_TOKENS = 4096  # tokens of held-out text read for spread and activated parameters


@dataclass
class AnalysisOptions:
    ckpt: str  # the checkpoint analysed (recorded in the report)
    prompt: str = DEFAULT_PROMPT  # attribution's prompt, and the default query token's source
    predict: str | None = None  # the token whose log-prob is attributed; None: the model's top next token
    token: str | None = None  # nearest's query token; None: the prompt's first word token
    top_k: int = 10  # nearest tokens listed per table
    dense: str | None = None  # a dense checkpoint whose W_up x is the spread's baseline
    text: str | None = None  # a text file for spread / activated; None: the held-out corpus
    max_tokens: int | None = 512  # distinct tokens compared in the spread
    only: str = "all"  # comma list of ANALYSES, or all
    no_progress: bool = False  # no progress bar on stderr

    @classmethod
    def from_args(cls, args) -> AnalysisOptions:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def text_ids(options: AnalysisOptions, tokenizer) -> list[int]:
    """Up to TEXT_TOKENS ids of `options.text` (a file), else of the embedded corpus's held-out split."""
    if options.text is not None:
        from stemlm.data.sources import read_texts

        text = "\n".join(read_texts([options.text]))  # one-line errors for a missing, binary or non-UTF-8 file
    else:
        from stemlm.data import embedded_texts

        text = "\n".join(embedded_texts("heldout"))[: TEXT_TOKENS * 8]
    ids = tokenizer.encode(text).ids[:TEXT_TOKENS]
    if len(ids) < 3:
        raise StemlmError("the analysis text encodes to fewer than 3 tokens; pass a longer --text")
    return ids


def default_token(tokenizer, prompt_ids: list[int]) -> str:
    """The query token of `nearest` when none is named: the prompt's first name that is one token (" Spain" in "The
    capital of Spain is"), else its first whole word of >= 4 letters (a sub-word such as "ital" of " cap" + "ital"
    makes a poor subject), else the first piece of a name inside the prompt, else of any word, else the last
    token."""
    pieces = [tokenizer.decode([i]) for i in prompt_ids]
    initial = [i for i, piece in enumerate(pieces) if (i == 0 or piece.startswith(" ")) and piece.strip().isalpha()]
    names = [i for i in initial if i > 0 and pieces[i].strip()[0].isupper()]  # a capital opening a sentence is no name
    whole = [  # a whole word: the next piece starts another word or is a mark
        i for i in initial if len(pieces[i].strip()) >= 4 and (i + 1 == len(pieces) or not pieces[i + 1][:1].isalpha())
    ]
    choice = [i for i in whole if i in names] or whole or names or initial or [len(pieces) - 1]
    return pieces[choice[0]]


def chosen_analyses(options: AnalysisOptions, model) -> list[str]:
    """The analyses `options.only` names (all: every one that applies; a dense model skips the STEM-only ones)."""
    names = ANALYSES if options.only == "all" else [n.strip() for n in options.only.split(",") if n.strip()]
    for n in names:
        if n not in ANALYSES:
            raise StemlmError(f"unknown analysis {n!r}; choose from {', '.join(ANALYSES)} (comma list) or all")
    if not model.token_tables():
        asked = [n for n in names if n in STEM_ONLY]
        if options.only != "all" and asked:
            raise StemlmError(f"{', '.join(asked)} need a STEM checkpoint; this one is dense (ffn=dense)")
        names = [n for n in names if n not in STEM_ONLY]
    return list(names)


def run_analyses(options: AnalysisOptions, model, tokenizer, names, prompt_ids, out: Path, final: Path) -> dict:
    """Every chosen analysis, its PNG and analysis.json written into `out` (the temporary folder of the atomic
    write to `final`); the report `stemlm analyze --json` prints. Inputs are read first, so a bad text or dense
    checkpoint fails before the progress bar (one step per analysis, on stderr unless `options.no_progress`)."""
    from stemlm.analysis import activated, attribution, nearest, spread
    from stemlm.checkpoint.runs import load_checkpoint
    from stemlm.progress import bar as progress_bar

    report: dict = {"checkpoint": options.ckpt, "prompt": options.prompt, "out": str(final), "pngs": {}}
    if "spread" in names or "activated" in names:
        ids = text_ids(options, tokenizer)
    dense = load_checkpoint(options.dense)[0] if options.dense and "spread" in names else None
    bar = progress_bar(len(names), progress=not options.no_progress, desc="analyze", unit="analysis")
    with bar:
        if "spread" in names:
            bar.set_postfix_str("spread")
            result, samples = spread.angular_spread(model, ids, dense=dense, max_tokens=options.max_tokens)
            report["spread"] = result
            name = "dense W_up x" if dense is not None else "own gate_proj(x)"
            report["pngs"]["spread"] = str(spread.plot_spread(samples, name, out / "spread.png"))
            bar.update()
        if "attribution" in names:
            bar.set_postfix_str("attribution")
            target = None
            if options.predict is not None:
                target = nearest.query_token(tokenizer, options.predict, model.config.vocab_size)
            result = attribution.attribute(model, prompt_ids, target)
            token = tokenizer.decode([result["token_id"]])
            report["attribution"] = {**result, "prompt": options.prompt, "token": token}
            labels = [tokenizer.decode([i]) for i in prompt_ids]
            png = attribution.plot_attribution(result, labels, token, out / "attribution.png")
            report["pngs"]["attribution"] = str(png)
            bar.update()
        if "nearest" in names:
            bar.set_postfix_str("nearest")
            token = options.token or default_token(tokenizer, prompt_ids)
            report["nearest"] = nearest.nearest_tokens(model, tokenizer, token, options.top_k)
            report["pngs"]["nearest"] = str(nearest.plot_nearest(report["nearest"], out / "nearest.png"))
            bar.update()
        if "activated" in names:
            bar.set_postfix_str("activated")
            report["activated"] = activated.activated_vs_context(model.config, ids)
            report["pngs"]["activated"] = str(activated.plot_activated(report["activated"], out / "activated.png"))
            bar.update()
    pngs = {name: str(final / Path(png).name) for name, png in report["pngs"].items()}
    (out / "analysis.json").write_text(json.dumps({**report, "pngs": pngs}, indent=2) + "\n")
    return report


def render_analysis(report: dict) -> str:
    """The text `stemlm analyze` prints for a `run_analyses` report."""
    lines = [f"prompt: {report['prompt']!r}"]
    if "spread" in report:
        lines.append(
            f"angular spread over {report['spread']['tokens']} tokens (baseline: {report['spread']['baseline']}):"
        )
        for r in report["spread"]["layers"].values():
            s, b = r["stem_rows"], r["baseline"]
            lines.append(
                f"  {r['label']}: mean cos STEM rows {s['mean']:+.3f} (|cos| {s['mean_abs']:.3f})"
                f"  vs baseline {b['mean']:+.3f} (|cos| {b['mean_abs']:.3f})"
            )
    if "attribution" in report:
        a = report["attribution"]
        lines.append(f"attribution for {a['token']!r} (log p {a['logprob']:.3f}):")
        for r in a["layers"].values():
            top = max(range(len(r["grad_x_input"])), key=lambda i: abs(r["grad_x_input"][i]))
            lines.append(f"  {r['label']}: strongest grad x input at position {top} ({r['grad_x_input'][top]:+.4f})")
    if "nearest" in report:
        n = report["nearest"]
        lines.append(f"nearest tokens to {n['query']!r}:")
        for table, rows in n["tables"].items():
            lines.append(f"  {table}: " + ", ".join(f"{r['token']!r} {r['cosine']:.2f}" for r in rows[:5]))
    if "activated" in report:
        lines.append("activated STEM parameters by context length:")
        for r in report["activated"]["by_context"]:
            lines.append(
                f"  {r['context']:>6} tokens: {r['distinct_tokens']:.0f} distinct -> "
                f"{r['activated_table_params']:,.0f} table params"
            )
    return "\n".join(lines)
