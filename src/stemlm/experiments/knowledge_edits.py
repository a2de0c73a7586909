"""The knowledge experiment's edit scoring: positional edits of one seed's models, and the diagnostics.

`edit_results(cfg, models, tokenizer, log)` scores `stemlm.edit.evaluate` edits on the STEM model (STEM rows,
embedding rows, both), the dense control (embedding rows) and, when trained, the dense control whose token
embedding had the tables' lr and wd (`dense_embed`); then the diagnostics: one STEM layer at a time, the
global (table) form, and pad rows / strategies on records whose names differ in length. Called from
`stemlm.experiments.knowledge.score_edits`, the one place to swap in other edit metrics.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer

from stemlm.choices import EDIT_ROWS
from stemlm.data.worlds.facts import edit_records
from stemlm.edit.evaluate import evaluate_edits, summarize
from stemlm.edit.spans import entity_ids


def _length_groups(tokenizer: Tokenizer, records, vocab: int) -> dict[str, list]:
    groups: dict[str, list] = {"equal": [], "source_longer": [], "target_longer": []}
    for r in records:
        s = len(entity_ids(tokenizer, r.subject, vocab_size=vocab))
        t = len(entity_ids(tokenizer, r.target_subject, vocab_size=vocab))
        groups["equal" if s == t else "source_longer" if s > t else "target_longer"].append(r)
    return groups


def edit_results(cfg, models: dict, tokenizer: Tokenizer, log) -> dict:
    records = edit_records(cfg.edit_relation, cfg.edit_records or None, seed=cfg.seed)
    stem, dense = models["stem"], models["dense"]
    caches: dict[str, dict] = {"stem": {}, "dense": {}}  # unedited scores, shared by every variant of a model
    common = dict(fluency_records=cfg.fluency_records)
    variants = {}
    for rows in EDIT_ROWS:
        log(f"edits: STEM model, {rows} rows")
        variants[f"stem-{rows}"] = evaluate_edits(
            stem, tokenizer, records, rows=rows, cache=caches["stem"], details=True, **common
        )
    log("edits: dense control, embedding rows")
    variants["dense-embed"] = evaluate_edits(dense, tokenizer, records, rows="embed", cache=caches["dense"], **common)
    if "dense_embed" in models:
        log("edits: dense control trained with embedding lr and wd like STEM's tables, embedding rows")
        variants["dense_embed-embed"] = evaluate_edits(
            models["dense_embed"], tokenizer, records, rows="embed", **common
        )
    result = {"records": len(records), "variants": variants, "by_length": by_length(tokenizer, stem, variants)}
    if cfg.diagnostics:
        result["diagnostics"] = diagnostics(cfg, stem, tokenizer, records, caches["stem"], log)
    return result


def by_length(tokenizer: Tokenizer, stem, variants: dict) -> dict:
    """The STEM-model variants split by name lengths: single-token pairs, other equal lengths, mismatches."""
    out = {}
    for name, result in variants.items():
        details = result.pop("details", None)
        if not details:
            continue
        kinds: dict[str, list] = {}
        for row in details:
            s = len(entity_ids(tokenizer, row["subject"], vocab_size=stem.config.vocab_size))
            t = len(entity_ids(tokenizer, row["target_subject"], vocab_size=stem.config.vocab_size))
            kind = "1->1" if s == t == 1 else "equal" if s == t else "source_longer" if s > t else "target_longer"
            kinds.setdefault(kind, []).append(row)
        out.update({f"{name}:{kind}": summarize(rows) for kind, rows in sorted(kinds.items())})
    return out


def diagnostics(cfg, stem, tokenizer: Tokenizer, records, cache: dict, log) -> dict:
    """Where the fact lives and which strategy works: single STEM layers, global mode, mismatch strategies."""
    quick = dict(fluency_tokens=0, cache=cache)
    out: dict = {"layers": {}, "mismatch": {}}
    for layer in sorted(stem.token_tables()):
        for rows in ("tables", "both"):
            log(f"diagnostics: layer {layer}, {rows} rows")
            out["layers"][f"layer{layer}-{rows}"] = evaluate_edits(
                stem, tokenizer, records, rows=rows, layers=[layer], **quick
            )
    log("diagnostics: global (table) edits")
    out["global-tables"] = evaluate_edits(stem, tokenizer, records, rows="tables", mode="global", **quick)
    out["global-both"] = evaluate_edits(stem, tokenizer, records, rows="both", mode="global", **quick)
    everything = edit_records(cfg.edit_relation, None, seed=cfg.seed)
    groups = _length_groups(tokenizer, everything, stem.config.vocab_size)
    out["length_groups"] = {k: len(v) for k, v in groups.items()}
    plans = {
        "source_longer": [
            ("copy", "source"),
            ("left_pad", "source"),
            ("left_pad", "eot"),
            ("left_pad", "zero"),
            ("right_pad", "source"),
        ],
        "target_longer": [("subset", "source"), ("average", "source")],
    }
    for group, settings in plans.items():
        for strategy, pad in settings:
            if not groups[group]:
                continue
            log(f"diagnostics: {group}, {strategy}/{pad}")
            out["mismatch"][f"{group}:{strategy}:{pad}"] = evaluate_edits(
                stem, tokenizer, groups[group], rows="tables", strategy=strategy, pad=pad, **quick
            )
    out["row_norms"] = row_norms(stem, tokenizer, groups["target_longer"])
    return out


@torch.no_grad()
def row_norms(stem, tokenizer: Tokenizer, records) -> dict:
    """Mean L2 norm, per STEM layer, of single target rows vs the averaged rows `average` would use."""
    out = {}
    for layer, table in stem.token_tables().items():
        single, averaged = [], []
        for r in records:
            ids = entity_ids(tokenizer, r.target_subject, vocab_size=stem.config.vocab_size)
            rows = table.weight[ids]
            single += rows.norm(dim=-1).tolist()
            averaged.append(float(rows.mean(0).norm()))
        if single:
            out[str(layer)] = {"single_row": sum(single) / len(single), "averaged": sum(averaged) / len(averaged)}
    return out
