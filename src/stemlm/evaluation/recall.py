"""Exact greedy recall of fact-world answers: does the model's greedy continuation of a prompt equal the answer?

`greedy_matches` scores (prompt ids, answer ids) pairs teacher-forced in batches; `fact_recall` scores the fact
world's prompts of each template split ("train": the phrasings trained on, "heldout": others) per relation.
Used by `stemlm train`'s final report (the mixed-in capitals) and the knowledge experiment.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from stemlm.data.worlds.facts import fact_prompts


@torch.no_grad()
def greedy_matches(model, pairs: list[tuple[list[int], list[int]]], batch_size: int = 128) -> list[bool]:
    """For each (prompt ids, answer ids): does greedy decoding reproduce the answer exactly? Teacher-forced
    argmax over the answer positions, which is the greedy continuation as long as every token matches."""
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        width = max(len(p) + len(a) for p, a in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        for b, (p, a) in enumerate(chunk):
            ids[b, : len(p) + len(a)] = torch.tensor(p + a)
        pred = model(ids.to(device)).logits.argmax(-1).cpu()
        for b, (p, a) in enumerate(chunk):
            out.append(bool((pred[b, len(p) - 1 : len(p) - 1 + len(a)] == torch.tensor(a)).all()))
    return out


def fact_recall(model, tokenizer, relations: tuple[str, ...], region: str | Sequence[str] | None = None) -> dict:
    """{split: {"prompts": n, "recall": share, <relation>: share or None}} over the countries of `region`
    (a region name or a list of countries; None: every country)."""
    result = {}
    for split in ("train", "heldout"):
        prompts = fact_prompts(split, relations, region=region)
        pairs = [(tokenizer.encode(p.prompt).ids, tokenizer.encode(p.answer).ids) for p in prompts]
        hits = greedy_matches(model, pairs)
        result[split] = {"prompts": len(prompts), "recall": sum(hits) / len(hits)}
        for rel in relations:
            rel_hits = [h for h, p in zip(hits, prompts, strict=True) if p.relation == rel]
            result[split][rel] = sum(rel_hits) / len(rel_hits) if rel_hits else None
    return result
