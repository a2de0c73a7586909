"""Edit metrics on CounterFact-style records: efficacy, paraphrase, neighbourhood and generation fluency.

For each `stemlm.facts.EditRecord` the subject's rows are replaced by the target subject's rows and

- efficacy: the new target's full continuation outscores the true one on the edited prompt (sums of token
  log-probabilities, so multi-token answers compare fairly as sequences);
- paraphrase: the same on the record's other prompts (other training templates and held-out ones);
- neighbourhood: other subjects keep their answer (their true target still beats the record's new target).
  Positional mode puts the neighbour prompt after the edited sentence ("The capital of Spain[edited] is
  Berlin. The capital of Chile is"), since a positional edit cannot reach a text without the source; global
  mode asks neighbour prompts on their own with the edited rows wherever the source tokens occur;
- fluency: the n-gram entropy of a greedy generation from the edited prompt (ROME's measure: 2/3 bigram +
  4/3 trigram entropy in bits over words, averaged), beside the unedited model's.

Also reported: the same metrics unedited (the baseline each edit moves from), `known` (records whose true
target is the unedited greedy continuation) and the metrics on those, `erased` (greedy no longer gives the
true target) and `new_greedy` (greedy now gives the new target), and the mean log-prob margin new - true.
Row kinds: "stem" (table rows), "embed" (token embedding rows: the only kind a dense model has), "both".

    from stemlm.edit.evaluate import evaluate_edits
    result = evaluate_edits(model, tokenizer, edit_records("capital", 50), rows="stem")
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from stemlm.edit.positional import Hooks, PositionalEdit, batch_hooks, edit_hooks, greedy_generate, make_edit
from stemlm.edit.spans import DEFAULT_PAD, GLOBAL_DEFAULT_PAD, align, entity_ids, locate, tokenizer_eot
from stemlm.edit.table_edits import global_edit_hooks
from stemlm.errors import StemlmError
from stemlm.facts import EditRecord
from stemlm.model.decoder import StemLM

MODES = ("positional", "global")
FLUENCY_TOKENS = 24
METRICS = ("efficacy", "paraphrase", "neighborhood")


Item = tuple[list[int], list[int]]  # (prompt ids, continuation ids)


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


@torch.no_grad()
def score_items(model: StemLM, items: Sequence[Item], hooks: Hooks = (None, None)) -> list[tuple[float, bool]]:
    """(sum of continuation log-probs, greedy exact match) of each (prompt, continuation), in one forward.

    Rows are right-padded; with causal attention padding after a sequence never changes its scores."""
    width = max(len(p) + len(c) for p, c in items)
    ids = torch.zeros(len(items), width, dtype=torch.long, device=next(model.parameters()).device)
    for b, (p, c) in enumerate(items):
        ids[b, : len(p) + len(c)] = torch.as_tensor(list(p) + list(c))
    logp = model(ids, table_rows=hooks[0], embed_rows=hooks[1]).logits.float().log_softmax(-1)
    out = []
    for b, (p, c) in enumerate(items):
        rows = logp[b, len(p) - 1 : len(p) - 1 + len(c)]
        target = torch.as_tensor(list(c), device=rows.device)
        out.append((float(rows.gather(1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all())))
    return out


def score_continuations(
    model: StemLM, prompt_ids: Sequence[int], continuations: Sequence[Sequence[int]], hooks: Hooks = (None, None)
) -> list[tuple[float, bool]]:
    """`score_items` for several continuations of one prompt."""
    return score_items(model, [(list(prompt_ids), list(c)) for c in continuations], hooks)


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
    kind: str  # efficacy | paraphrase | neighborhood
    prompt: list[int]
    good: list[int]  # the continuation that should win (new target for efficacy/paraphrase, own answer for neighbours)
    bad: list[int]
    span: list[int] | None  # the prefix holding the edited subject (positional mode)


class _Editor:
    """One record's edit: its queries, and hooks scoring them edited in one batched forward."""

    def __init__(self, model, tokenizer, record: EditRecord, rows, strategy, pad, layers, mode) -> None:
        self.model, self.tokenizer, self.record, self.mode = model, tokenizer, record, mode
        self.kw = dict(strategy=strategy, pad=pad, layers=layers, rows=rows)
        if mode == "global":
            vocab = model.config.vocab_size
            src = entity_ids(tokenizer, record.subject, vocab_size=vocab)
            tgt = entity_ids(tokenizer, record.target_subject, vocab_size=vocab)
            plan = align(len(src), tgt, strategy, pad, tokenizer_eot(tokenizer))
            self.global_hooks = global_edit_hooks(model, src, plan, layers=layers, rows=rows)

    def edit(self, span: list[int]) -> PositionalEdit:
        rec = self.record
        return make_edit(self.model, self.tokenizer, span, rec.subject, rec.target_subject, **self.kw)

    def hooks(self, queries: list[Query]) -> Hooks:
        """Hooks for the batch of `items(queries)`: two rows per query, each with its query's edit."""
        if self.mode == "global":
            return self.global_hooks
        edits = [self.edit(q.span) for q in queries]
        return batch_hooks(self.model, [e for e in edits for _ in range(2)])

    def queries(self) -> list[Query]:
        tok, rec = self.tokenizer, self.record
        true, new = encode(tok, rec.true_target), encode(tok, rec.new_target)
        prompt = encode(tok, rec.prompt)
        out = [Query("efficacy", prompt, new, true, prompt)]
        for text in rec.paraphrase_prompts:
            ids = encode(tok, text)
            try:
                locate(tok, ids, rec.subject, self.model.config.vocab_size)
                if self.mode == "positional":
                    self.edit(ids)
            except StemlmError:
                # No span to edit (the subject tokenizes differently inside this template), or a fixed strategy
                # that does not fit the name lengths of this form (bare "Spain" vs spaced " Spain").
                continue
            out.append(Query("paraphrase", ids, new, true, ids))
        context = encode(tok, f"{rec.prompt}{rec.new_target}.")
        for nb in rec.neighborhood:
            if nb.answer == rec.new_target:
                continue
            if self.mode == "positional":
                out.append(
                    Query("neighborhood", context + encode(tok, f" {nb.prompt}"), encode(tok, nb.answer), new, context)
                )
            else:
                out.append(Query("neighborhood", encode(tok, nb.prompt), encode(tok, nb.answer), new, None))
        return out


def _items(queries: list[Query]) -> list[Item]:
    return [item for q in queries for item in ((q.prompt, q.good), (q.prompt, q.bad))]


def _cached(cache: dict | None, key, compute):
    if cache is None:
        return compute()
    if key not in cache:
        cache[key] = compute()
    return cache[key]


def _fill(out: dict, tag: str, queries: list[Query], scores: list[tuple[float, bool]]) -> None:
    by_kind: dict[str, list[float]] = {"paraphrase": [], "neighborhood": []}
    for k, q in enumerate(queries):
        (good, good_greedy), (bad, bad_greedy) = scores[2 * k], scores[2 * k + 1]
        if q.kind == "efficacy":
            out[f"{tag}efficacy"], out[f"{tag}margin"] = float(good > bad), good - bad
            out[f"{tag}new_greedy"], out[f"{tag}true_greedy"] = good_greedy, bad_greedy
        else:
            by_kind[q.kind].append(float(good > bad))
    for kind, values in by_kind.items():
        out[f"{tag}{kind}"] = sum(values) / len(values) if values else float("nan")


def _record_metrics(editor: _Editor, fluency_tokens: int, cache: dict | None) -> dict:
    model, tok, rec = editor.model, editor.tokenizer, editor.record
    queries = editor.queries()
    items = _items(queries)
    out: dict = {"subject": rec.subject, "target_subject": rec.target_subject}
    _fill(out, "", queries, score_items(model, items, editor.hooks(queries)))
    key = ("score", id(model), tuple((tuple(p), tuple(c)) for p, c in items))
    _fill(out, "unedited_", queries, _cached(cache, key, lambda: score_items(model, items)))
    out["known"], out["erased"] = out["unedited_true_greedy"], not out["true_greedy"]
    if fluency_tokens:
        prompt = queries[0].prompt
        if editor.mode == "global":  # a global edit applies to generated tokens too
            hooks = decode = editor.global_hooks
        else:  # positional: substituted at prefill, read from the KV cache afterwards
            hooks, decode = edit_hooks(model, editor.edit(prompt)), (None, None)
        edited_ids = greedy_generate(model, prompt, fluency_tokens, prefill=hooks, decode=decode)
        key = ("generate", id(model), tuple(prompt), fluency_tokens)
        plain = _cached(cache, key, lambda: greedy_generate(model, prompt, fluency_tokens))
        out["fluency"], out["unedited_fluency"] = (
            ngram_entropy(tok.decode(edited_ids)),
            ngram_entropy(tok.decode(plain)),
        )
        out["generation"] = tok.decode(edited_ids)
    return out


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else None


def summarize(per_record: list[dict]) -> dict:
    """Means over records of every metric, edited and unedited, over all records and over `known` ones."""
    summary: dict = {"records": len(per_record), "known": sum(r["known"] for r in per_record)}
    keys = [*METRICS, "margin", "fluency"]
    for prefix in ("", "unedited_"):
        for key in keys:
            values = [float(r[f"{prefix}{key}"]) for r in per_record if f"{prefix}{key}" in r]
            if values:
                summary[f"{prefix}{key}"] = _mean(values)
    known = [r for r in per_record if r["known"]]
    for key in METRICS:
        summary[f"known_{key}"] = _mean([r[key] for r in known])
    summary["erased"] = _mean([float(r["erased"]) for r in known])
    summary["new_greedy"] = _mean([float(r["new_greedy"]) for r in per_record])
    return summary


def evaluate_edits(
    model: StemLM,
    tokenizer: Tokenizer,
    records: Sequence[EditRecord],
    *,
    rows: str = "stem",
    strategy: str = "auto",
    pad: str | None = None,
    layers: Sequence[int] | None = None,
    mode: str = "positional",
    fluency_tokens: int = FLUENCY_TOKENS,
    fluency_records: int | None = None,
    details: bool = False,
    cache: dict | None = None,
) -> dict:
    """Summary metrics (and with `details`, one dict per record) of swapping each record's subject rows.

    Fluency (greedy generations, the slow part) is measured on the first `fluency_records` records (all: None).
    `cache`, a dict the caller keeps for one model, reuses the unedited scores and generations across calls
    (they do not depend on the edit settings), halving the cost of evaluating several variants."""
    if mode not in MODES:
        raise StemlmError(f"unknown edit mode {mode!r}; choose one of {', '.join(MODES)}")
    if not records:
        raise StemlmError("no edit records to evaluate")
    pad = pad or (DEFAULT_PAD if mode == "positional" else GLOBAL_DEFAULT_PAD)
    per_record = [
        _record_metrics(
            _Editor(model, tokenizer, r, rows, strategy, pad, layers, mode),
            fluency_tokens if fluency_records is None or k < fluency_records else 0,
            cache,
        )
        for k, r in enumerate(records)
    ]
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
