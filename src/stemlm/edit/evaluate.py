"""Edit metrics on CounterFact-style records, each beside its unedited value and its chance level.

For each `stemlm.data.worlds.facts.EditRecord` the subject's rows are replaced by the target subject's rows, and every
probe below is scored twice on the same text, edited and unedited:

- prompt sets `train` (the edit prompt and the other training templates) and `heldout` (held-out phrasings
  only: the paraphrases): `new_greedy` (the greedy continuation is exactly the new object; chance 1/K for a
  relation with K objects), `new_beats_true` (P(new) > P(true) as sums of token log-probabilities; chance
  0.5) and `true_greedy` (the greedy continuation is still the true object);
- `portability`: the subject's other relations (language, currency, ...; every attribute in the bio world)
  should follow the target subject: `new_greedy`, `new_beats_true` with the other relation's chance;
- locality, positional mode: after the edited sentence ("The capital of Spain[edited] is Berlin.") ask
  `locality_other` another subject ("The capital of Chile is") or `locality_same` the same subject at an
  unedited position ("The capital of Spain is"); an edit that leaks through attention fails them.
  `kept_greedy` (its own answer is still the greedy continuation), `own_beats_new` and `unchanged` (the
  teacher-forced argmax along its answer is identical to the unedited model's on the same text, 1 when
  nothing leaks, whatever the model knows);
- `neighborhood`, global mode only (a global edit changes the source tokens everywhere, so other subjects
  asked on their own are what it can break): the same three figures;
- `paraphrase_moved`: of the held-out phrasings the unedited model answers with the true object, the share
  the edit moves to the new object (greedy), counted per phrasing over every record, and the same split by
  how the target's name compares with the source's in tokens (`by_length`: equal, longer, shorter), since a
  name of another length cannot take the target's rows one to one;
- fluency: the n-gram entropy of a greedy generation from the edit prompt (ROME's measure: 2/3 bigram +
  4/3 trigram entropy in bits over words, averaged), beside the unedited model's.

A record is `known` when the unedited greedy continuation of its edit prompt is its true object. Summaries
are over known records (`scored_on`), since an edit of a fact the model does not know moves nothing that
was there; the same figures over all records are under `all_records`. Scoring is batched across records
(positional edits carry one edit per batch row through `batch_hooks`). `evaluate_variants` runs it for several row
kinds (`edit_variants`: stem, embed, both) with the unedited scores shared; `evaluate_checkpoint_edits` is
`stemlm eval edits` (a checkpoint, its records, and a dense control).

    from stemlm.edit.evaluate import evaluate_edits, format_edit_table
    result = evaluate_edits(model, tokenizer, edit_records("capital", 50), rows="tables")
    print(format_edit_table({"tables": result}))
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from stemlm.choices import EDIT_MODES, EDIT_ROWS, edit_row_kind
from stemlm.data.worlds.facts import EditRecord
from stemlm.edit.positional import Hooks, PositionalEdit, batch_hooks, edit_hooks, greedy_generate, make_edit
from stemlm.edit.spans import DEFAULT_PAD, GLOBAL_DEFAULT_PAD, align, entity_ids, locate, tokenizer_eot
from stemlm.edit.table_edits import global_edit_hooks
from stemlm.errors import StemlmError
from stemlm.model.decoder import StemLM

FLUENCY_TOKENS = 24
BATCH_ROWS = 128
EDIT_SETS = ("train", "heldout", "portability")  # probes that should follow the edit
LOCAL_SETS = ("locality_other", "locality_same", "neighborhood")  # probes that should not
SET_METRICS = {s: ("new_greedy", "new_beats_true", "true_greedy") for s in EDIT_SETS}
SET_METRICS.update({s: ("kept_greedy", "own_beats_new", "unchanged") for s in LOCAL_SETS})

Item = tuple[list[int], list[int]]  # (prompt ids, continuation ids)
Score = tuple[float, bool, tuple[int, ...]]  # (sum of continuation log-probs, greedy exact match, argmax ids)


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


@torch.no_grad()
def score_items(
    model: StemLM, items: Sequence[Item], hooks: Hooks = None, batch_rows: int | None = None
) -> list[Score]:
    """(sum of continuation log-probs, greedy exact match, argmax ids) of each (prompt, continuation).

    Rows are right-padded; with causal attention padding after a sequence never changes its scores. Hooks
    see the whole batch, so they must be built for exactly these rows: `batch_rows` (chunking) is only for
    hook-free calls."""
    if batch_rows is not None and len(items) > batch_rows:
        if hooks is not None:
            raise ValueError("chunked scoring needs hook-free calls; build hooks per chunk instead")
        return [s for k in range(0, len(items), batch_rows) for s in score_items(model, items[k : k + batch_rows])]
    if not items:
        return []
    width = max(len(p) + len(c) for p, c in items)
    ids = torch.zeros(len(items), width, dtype=torch.long, device=next(model.parameters()).device)
    for b, (p, c) in enumerate(items):
        ids[b, : len(p) + len(c)] = torch.as_tensor(list(p) + list(c))
    logp = model(ids, rows=hooks).logits.float().log_softmax(-1)
    out = []
    for b, (p, c) in enumerate(items):
        rows = logp[b, len(p) - 1 : len(p) - 1 + len(c)]
        target = torch.as_tensor(list(c), device=rows.device)
        argmax = rows.argmax(-1)
        out.append(
            (float(rows.gather(1, target[:, None]).sum()), bool((argmax == target).all()), tuple(argmax.tolist()))
        )
    return out


def score_continuations(
    model: StemLM, prompt_ids: Sequence[int], continuations: Sequence[Sequence[int]], hooks: Hooks = None
) -> list[tuple[float, bool]]:
    """(sum of log-probs, greedy exact match) of several continuations of one prompt."""
    return [s[:2] for s in score_items(model, [(list(prompt_ids), list(c)) for c in continuations], hooks)]


def ngram_entropy(text: str, ns: tuple[int, ...] = (2, 3), weights: tuple[float, ...] = (2 / 3, 4 / 3)) -> float:
    """ROME's fluency measure: the weighted mean over n of the entropy (bits) of the text's word n-grams."""
    words = text.split()
    values = []
    for n, w in zip(ns, weights, strict=True):
        counts = Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
        total = sum(counts.values())
        h = -sum(c / total * math.log2(c / total) for c in counts.values()) if total else 0.0
        values.append(w * h)
    return sum(values) / len(values)


@dataclass
class Query:
    kind: str  # one of EDIT_SETS or LOCAL_SETS
    prompt: list[int]
    good: list[int]  # should win: the new object (EDIT_SETS) or the probe's own answer (LOCAL_SETS)
    bad: list[int]  # the true object (EDIT_SETS) or the record's new object (LOCAL_SETS)
    span: list[int] | None  # the prefix whose source occurrences are edited (positional mode)
    choices: int | None = None  # objects of the probed relation: greedy chance 1/choices


class _Editor:
    """One record's edit and its queries."""

    def __init__(self, model, tokenizer, record: EditRecord, rows, strategy, pad, layers, mode) -> None:
        self.model, self.tokenizer, self.record, self.mode = model, tokenizer, record, mode
        self.kw = dict(strategy=strategy, pad=pad, layers=layers, rows=rows)
        if mode == "global":
            vocab = model.config.vocab_size
            src = entity_ids(tokenizer, record.subject, vocab_size=vocab)
            tgt = entity_ids(tokenizer, record.target_subject, vocab_size=vocab)
            plan = align(len(src), tgt, strategy, pad, tokenizer_eot(tokenizer))
            self.global_hooks = global_edit_hooks(model, src, plan, layers=layers, rows=rows)

    def lengths(self) -> str:
        """How the target's name compares with the source's in tokens (as they read after a space): `equal`,
        `longer_target` (rows subset or averaged onto the source's positions) or `shorter_target` (padded or
        copied)."""
        vocab = self.model.config.vocab_size
        src = len(entity_ids(self.tokenizer, self.record.subject, vocab_size=vocab))
        tgt = len(entity_ids(self.tokenizer, self.record.target_subject, vocab_size=vocab))
        return "equal" if src == tgt else "longer_target" if tgt > src else "shorter_target"

    def edit(self, span: list[int]) -> PositionalEdit:
        rec = self.record
        return make_edit(self.model, self.tokenizer, span, rec.subject, rec.target_subject, **self.kw)

    def _editable(self, ids: list[int]) -> bool:
        try:
            locate(self.tokenizer, ids, self.record.subject, self.model.config.vocab_size)
            if self.mode == "positional":
                self.edit(ids)
        except StemlmError:
            # The subject tokenizes differently inside this template, or a fixed strategy does not fit the
            # name lengths of this form (bare "Spain" vs spaced " Spain"): nothing to edit, no probe.
            return False
        return True

    def queries(self) -> list[Query]:
        tok, rec = self.tokenizer, self.record
        true, new = encode(tok, rec.true_target), encode(tok, rec.new_target)
        k = rec.choices.get(rec.relation)
        prompt = encode(tok, rec.prompt)
        out = [Query("train", prompt, new, true, prompt, k)]  # first: the edit prompt (decides `known`)
        for kind, texts in (("train", rec.train_prompts), ("heldout", rec.paraphrase_prompts)):
            for ids in (encode(tok, t) for t in texts):
                if self._editable(ids):
                    out.append(Query(kind, ids, new, true, ids, k))
        for p in rec.portability:
            ids = encode(tok, p.prompt)
            if self._editable(ids):
                out.append(
                    Query(
                        "portability",
                        ids,
                        encode(tok, p.new_answer),
                        encode(tok, p.true_answer),
                        ids,
                        rec.choices.get(p.relation),
                    )
                )
        if self.mode == "global":
            for nb in rec.neighborhood:
                if nb.answer != rec.new_target:
                    out.append(Query("neighborhood", encode(tok, nb.prompt), encode(tok, nb.answer), new, None))
            return out
        context = encode(tok, f"{rec.prompt}{rec.new_target}.")
        for nb in rec.neighborhood:
            if nb.answer != rec.new_target:
                ids = context + encode(tok, f" {nb.prompt}")
                out.append(Query("locality_other", ids, encode(tok, nb.answer), new, context))
        out.append(Query("locality_same", context + encode(tok, f" {rec.prompt}"), true, new, context))
        return out


def _items(queries: list[Query]) -> list[Item]:
    return [item for q in queries for item in ((q.prompt, q.good), (q.prompt, q.bad))]


def _score_edited(model, editors: list[_Editor], queries: list[list[Query]], batch_rows: int) -> list[list[Score]]:
    """Edited scores of every record's items: positional edits batched across records (each batch row carries
    its own query's edit), global edits one forward per record (their hooks act on whole token ids)."""
    if not editors:
        return []
    if editors[0].mode == "global":
        return [score_items(model, _items(qs), e.global_hooks) for e, qs in zip(editors, queries, strict=True)]
    flat = [(r, q, e.edit(q.span)) for r, (e, qs) in enumerate(zip(editors, queries, strict=True)) for q in qs]
    rows = [(r, item, ed) for r, q, ed in flat for item in ((q.prompt, q.good), (q.prompt, q.bad))]
    order = sorted(range(len(rows)), key=lambda k: len(rows[k][1][0]) + len(rows[k][1][1]))  # little padding
    flat_scores: list[Score | None] = [None] * len(rows)
    for k in range(0, len(order), batch_rows):
        chunk = order[k : k + batch_rows]
        hooks = batch_hooks(model, [rows[j][2] for j in chunk])
        for j, s in zip(chunk, score_items(model, [rows[j][1] for j in chunk], hooks), strict=True):
            flat_scores[j] = s
    scores: list[list[Score]] = [[] for _ in editors]
    for (r, _, _), s in zip(rows, flat_scores, strict=True):
        scores[r].append(s)
    return scores


def _length(item) -> int:
    return len(item[0]) + len(item[1])


def _score_unedited(model, items_per_record: list[list[Item]], cache: dict | None, batch_rows: int):
    """Unedited scores, each distinct item computed once (and kept in `cache` across calls for this model)."""
    cache = {} if cache is None else cache
    missing = sorted({(tuple(p), tuple(c)) for items in items_per_record for p, c in items} - set(cache), key=_length)
    for key, s in zip(
        missing, score_items(model, [(list(p), list(c)) for p, c in missing], batch_rows=batch_rows), strict=True
    ):
        cache[key] = s
    return [[cache[(tuple(p), tuple(c))] for p, c in items] for items in items_per_record]


def _record_row(record: EditRecord, queries: list[Query], edited: list[Score], plain: list[Score]) -> dict:
    """Per-record values: for each probe set and metric, (edited mean, unedited mean, greedy chance)."""
    sums: dict[str, dict[str, list]] = {}
    for k, q in enumerate(queries):
        (eg, eg_greedy, eg_argmax), (eb, _, _) = edited[2 * k], edited[2 * k + 1]
        (ug, ug_greedy, ug_argmax), (ub, _, _) = plain[2 * k], plain[2 * k + 1]
        _, eb_greedy, _ = edited[2 * k + 1]
        _, ub_greedy, _ = plain[2 * k + 1]
        m = sums.setdefault(q.kind, {})
        if q.kind in EDIT_SETS:
            m.setdefault("new_greedy", []).append((eg_greedy, ug_greedy, 1 / q.choices if q.choices else None))
            m.setdefault("new_beats_true", []).append((eg > eb, ug > ub, 0.5))
            m.setdefault("true_greedy", []).append((eb_greedy, ub_greedy, None))
        else:
            m.setdefault("kept_greedy", []).append((eg_greedy, ug_greedy, None))
            m.setdefault("own_beats_new", []).append((eg > eb, ug > ub, 0.5))
            m.setdefault("unchanged", []).append((eg_argmax == ug_argmax, True, None))
    # The paraphrase test: held-out phrasings the unedited model answers with the true object, and of those the
    # ones the edit moves to the new object (greedy both ways); known per phrasing, not per record.
    paraphrases = [(plain[2 * k + 1][1], edited[2 * k][1]) for k, q in enumerate(queries) if q.kind == "heldout"]
    row: dict = {
        "subject": record.subject,
        "target_subject": record.target_subject,
        "paraphrases_known": sum(known for known, _ in paraphrases),
        "paraphrases_moved": sum(known and moved for known, moved in paraphrases),
    }
    for kind, metrics in sums.items():
        for name, values in metrics.items():
            chances = [c for _, _, c in values if c is not None]
            row[f"{kind}:{name}"] = (
                sum(float(e) for e, _, _ in values) / len(values),
                sum(float(u) for _, u, _ in values) / len(values),
                sum(chances) / len(chances) if chances else None,
            )
        row[f"{kind}:n"] = len(next(iter(metrics.values())))
    (eg, _, _), (eb, eb_greedy, _) = edited[0], edited[1]
    (ug, _, _), (ub, ub_greedy, _) = plain[0], plain[1]
    row.update(known=ub_greedy, erased=not eb_greedy, margin=eg - eb, unedited_margin=ug - ub)
    return row


def _fluency(editor: _Editor, prompt: list[int], tokens: int, cache: dict | None) -> tuple[float, float, str]:
    model, tok = editor.model, editor.tokenizer
    if editor.mode == "global":  # a global edit applies to generated tokens too
        hooks = decode = editor.global_hooks
    else:  # positional: substituted at prefill, read from the KV cache afterwards
        hooks, decode = edit_hooks(model, editor.edit(prompt)), None
    edited_ids = greedy_generate(model, prompt, tokens, prefill=hooks, decode=decode)
    key = ("generate", tuple(prompt), tokens)
    if cache is None or key not in cache:
        plain = greedy_generate(model, prompt, tokens)
        if cache is None:
            return ngram_entropy(tok.decode(edited_ids)), ngram_entropy(tok.decode(plain)), tok.decode(edited_ids)
        cache[key] = plain
    return ngram_entropy(tok.decode(edited_ids)), ngram_entropy(tok.decode(cache[key])), tok.decode(edited_ids)


def _mean(values) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else None


def summarize_sets(per_record: list[dict]) -> dict:
    """set -> metric -> {"edited", "unedited", "chance"} (means over records) plus set -> "n" (probes)."""
    out: dict = {}
    for kind in (*EDIT_SETS, *LOCAL_SETS):
        rows = [r for r in per_record if f"{kind}:n" in r]
        if not rows:
            continue
        entry: dict = {"n": sum(r[f"{kind}:n"] for r in rows), "records": len(rows)}
        for name in SET_METRICS[kind]:
            triples = [r[f"{kind}:{name}"] for r in rows]
            entry[name] = {
                "edited": _mean([t[0] for t in triples]),
                "unedited": _mean([t[1] for t in triples]),
                "chance": _mean([t[2] for t in triples]),
            }
        out[kind] = entry
    return out


def paraphrase_moved(per_record: list[dict], by_length: bool = True) -> dict:
    """{"known", "moved", "rate"}: over every record's held-out phrasings that the unedited model answers with
    the true object (whether or not it knows the edit prompt), the share whose greedy answer the edit makes the
    new object; rate None when the model knows none. `by_length`: the same per token-length relation of target
    and source name (`_Editor.lengths`: equal, longer_target, shorter_target), where the records say it."""
    known = sum(r["paraphrases_known"] for r in per_record)
    moved = sum(r["paraphrases_moved"] for r in per_record)
    out: dict = {"known": known, "moved": moved, "rate": moved / known if known else None}
    if by_length and any("lengths" in r for r in per_record):
        groups = sorted({r["lengths"] for r in per_record})
        out["by_length"] = {g: paraphrase_moved([r for r in per_record if r["lengths"] == g], False) for g in groups}
    return out


def summarize(per_record: list[dict]) -> dict:
    """Summary of per-record rows: counts, the sets over known records and over all records, erased,
    margins and fluency (means over known records; `all_records` keeps every record)."""
    known = [r for r in per_record if r["known"]]
    summary: dict = {
        "records": len(per_record),
        "known": len(known),
        "scored_on": "known",
        "sets": summarize_sets(known),
        "erased": _mean([float(r["erased"]) for r in known]),
        "margin": {
            "edited": _mean([r["margin"] for r in known]),
            "unedited": _mean([r["unedited_margin"] for r in known]),
        },
        "all_records": summarize_sets(per_record),
        "paraphrase_moved": paraphrase_moved(per_record),
    }
    fluent = [r for r in per_record if "fluency" in r]
    if fluent:
        summary["fluency"] = {
            "edited": _mean([r["fluency"] for r in fluent]),
            "unedited": _mean([r["unedited_fluency"] for r in fluent]),
            "n": len(fluent),
        }
    return summary


def evaluate_edits(
    model: StemLM,
    tokenizer: Tokenizer,
    records: Sequence[EditRecord],
    *,
    rows: str = "tables",
    strategy: str = "auto",
    pad: str | None = None,
    layers: Sequence[int] | None = None,
    mode: str = "positional",
    fluency_tokens: int = FLUENCY_TOKENS,
    fluency_records: int | None = None,
    details: bool = False,
    cache: dict | None = None,
    batch_rows: int = BATCH_ROWS,
) -> dict:
    """Summary metrics (and with `details`, one dict per record) of swapping each record's subject rows.

    Fluency (greedy generations, the slow part) is measured on the first `fluency_records` records (all: None).
    `cache`, a dict the caller keeps for one model, reuses the unedited scores and generations across calls
    (they do not depend on the edit settings). Positional scoring runs `batch_rows` rows per forward."""
    if mode not in EDIT_MODES:
        raise StemlmError(f"unknown edit mode {mode!r}; choose one of {', '.join(EDIT_MODES)}")
    if not records:
        raise StemlmError("no edit records to evaluate")
    pad = pad or (DEFAULT_PAD if mode == "positional" else GLOBAL_DEFAULT_PAD)
    editors = [_Editor(model, tokenizer, r, rows, strategy, pad, layers, mode) for r in records]
    queries = [e.queries() for e in editors]
    edited = _score_edited(model, editors, queries, batch_rows)
    plain = _score_unedited(model, [_items(qs) for qs in queries], cache, batch_rows)
    per_record = [
        _record_row(e.record, qs, ed, pl) | {"lengths": e.lengths()}
        for e, qs, ed, pl in zip(editors, queries, edited, plain, strict=True)
    ]
    if fluency_tokens:
        for k, (e, qs, row) in enumerate(zip(editors, queries, per_record, strict=True)):
            if fluency_records is None or k < fluency_records:
                row["fluency"], row["unedited_fluency"], row["generation"] = _fluency(
                    e, qs[0].prompt, fluency_tokens, cache
                )
    result = {
        "rows": rows,
        "mode": mode,
        "strategy": strategy,
        "pad": pad,
        "layers": list(layers) if layers is not None else "all",
        **summarize(per_record),
    }
    if details:
        result["details"] = per_record
    return result


def edit_variants(spec: str, model: StemLM) -> list[str]:
    """The row kinds `stemlm eval edits --variants` names (auto: all three for a STEM model, embed for dense)."""
    if spec == "auto":
        return list(EDIT_ROWS) if model.token_tables() else ["embed"]
    variants = [edit_row_kind(v.strip()) for v in spec.split(",") if v.strip()]
    for v in variants:
        if v not in EDIT_ROWS:
            raise StemlmError(f"unknown variant {v!r} in --variants; use a comma list of {', '.join(EDIT_ROWS)}")
    return variants


def evaluate_variants(model, tokenizer, records, variants: list[str], *, layers=None, log=print, **settings) -> dict:
    """`evaluate_edits` for each row kind of `variants` ({variant: summary}), the unedited scores computed once;
    `layers` selects the table layers of the stem and both variants (embedding rows have no layer)."""
    cache: dict = {}  # unedited scores and generations, shared by every variant of this model
    results = {}
    for variant in variants:
        log(f"evaluating {variant} rows on {len(records)} records ...")
        chosen = layers if variant != "embed" else None
        results[variant] = evaluate_edits(
            model, tokenizer, records, rows=variant, layers=chosen, cache=cache, **settings
        )
    return results


def record_countries(countries: str, ckpt: str) -> list[str] | str | None:
    """The region `--countries` names for CKPT: None (all), a list of countries, or the run's own (auto)."""
    from stemlm.checkpoint.runs import trained_fact_countries

    if countries == "auto":
        return trained_fact_countries(ckpt)
    if countries.strip().lower() == "all":
        return None
    names = [c.strip() for c in countries.split(",") if c.strip()]
    if not names:
        raise StemlmError(f"--countries {countries!r} names no country; give all, auto or a comma list of countries")
    return names


def evaluate_checkpoint_edits(
    ckpt: str,
    relation: str,
    records: int,
    *,
    seed: int,
    layers=None,
    variants="auto",
    dense=None,
    countries: str = "auto",
    log=print,
    **kw,
) -> dict:
    """`stemlm eval edits`: `records` edit records of `relation` (0: all) evaluated on CKPT for each row kind of
    `variants` (`edit_variants`), and on a `dense` checkpoint's embedding rows as the control when given; `kw` are
    `evaluate_edits`'s settings (strategy, pad, mode, fluency). `countries` picks the records' subjects and
    targets: all, a comma list of countries, or auto (the countries CKPT's run mixed into its training text, so
    the default run is scored on the facts it was taught; all for any other checkpoint)."""
    from stemlm.data.worlds.facts import edit_records
    from stemlm.edit.session import load_for_edit, parse_layers

    region = record_countries(countries, ckpt)
    try:
        chosen = edit_records(relation, records or None, seed=seed, region=region)
    except ValueError as exc:  # an unknown country or region names itself
        raise StemlmError(f"--countries {countries!r}: {exc}") from None
    model, tokenizer = load_for_edit(ckpt)
    table_layers = parse_layers(layers, model)
    if kw.get("fluency_records", 0) < 0:
        raise StemlmError(f"--fluency-records must be >= 0, got {kw['fluency_records']}")
    kinds = edit_variants(variants, model)
    results = {"checkpoint": ckpt, "relation": relation, "seed": seed, "countries": region or "all"}
    results["variants"] = evaluate_variants(model, tokenizer, chosen, kinds, layers=table_layers, log=log, **kw)
    if dense is not None:
        log(f"evaluating the dense control {dense} (embedding rows) ...")
        dense_model, dense_tok = load_for_edit(dense)
        results["variants"]["dense-embed"] = evaluate_edits(dense_model, dense_tok, chosen, rows="embed", **kw)
    return results
