"""Text tables of edit metrics: every figure beside its unedited value, a chance line and a legend.

    from stemlm.edit.report import format_edit_table
    print(format_edit_table({"tables": evaluate_edits(...), "dense-embed": evaluate_edits(...)}))

Cells read "edited (unedited)"; the summaries come from `stemlm.edit.evaluate.evaluate_edits`.
"""

from __future__ import annotations

# (set, metric, header): the columns, in order; a column appears when some summary has that set.
COLUMNS = (
    ("train", "new_greedy", "train: new greedy"),
    ("train", "new_beats_true", "train: P(new)>P(true)"),
    ("heldout", "new_greedy", "held-out: new greedy"),
    ("heldout", "new_beats_true", "held-out: P(new)>P(true)"),
    ("portability", "new_greedy", "portability: new greedy"),
    ("portability", "new_beats_true", "portability: P(new)>P(true)"),
    ("locality_other", "kept_greedy", "locality other: kept"),
    ("locality_other", "unchanged", "locality other: unchanged"),
    ("locality_same", "kept_greedy", "locality same: kept"),
    ("locality_same", "unchanged", "locality same: unchanged"),
    ("neighborhood", "kept_greedy", "neighbourhood: kept"),
    ("neighborhood", "unchanged", "neighbourhood: unchanged"),
)

LEGEND = {
    "known": "records whose unedited greedy continuation of the edit prompt is the true object; every other "
    "figure is a mean over these records only",
    "train": "the edit prompt and the other training templates of the edited relation",
    "held-out": "held-out phrasings only (never in training text): the paraphrase test",
    "portability": "the edited subject's other relations, which should now give the target subject's objects",
    "locality other": "another subject asked after the edited sentence in the same prompt (should keep its answer)",
    "locality same": "the same subject asked again at an unedited position after the edited sentence",
    "neighbourhood": "(global edits) other subjects asked on their own",
    "new greedy": "the greedy continuation is exactly the new object (chance 1/K for K objects)",
    "P(new)>P(true)": "the new object's sequence log-probability beats the true one's (chance 0.5)",
    "kept": "the probe's own answer is still its exact greedy continuation",
    "unchanged": "the argmax along the probe's answer is identical to the unedited model's on the same text "
    "(1.0 when nothing leaks; unedited value 1 by definition)",
    "paraphrases moved": "of the held-out phrasings (over every record) the unedited model answers with the true "
    "object, the share the edit makes answer the new object (greedy): rate (moved/known)",
    "erased": "known records whose edit prompt no longer continues greedily with the true object",
    "fluency": "n-gram entropy (bits) of a greedy generation from the edit prompt",
}


def _pair(entry: dict | None) -> str:
    if not entry or entry.get("edited") is None:
        return "-"
    unedited = entry.get("unedited")
    return f"{entry['edited']:.2f} ({unedited:.2f})" if unedited is not None else f"{entry['edited']:.2f}"


def _moved(entry: dict | None) -> str:
    if not entry or entry.get("rate") is None:
        return "-"
    return f"{entry['rate']:.2f} ({entry['moved']}/{entry['known']})"


def _split(summary: dict) -> bool:
    """Whether the summary's paraphrase rate has a split by name length with more than one group."""
    return len((summary.get("paraphrase_moved") or {}).get("by_length") or {}) > 1


def _columns(summaries: dict[str, dict]) -> list[tuple[str, str, str]]:
    present = {s for summary in summaries.values() for s in (*summary.get("sets", {}), *summary.get("all_records", {}))}
    return [c for c in COLUMNS if c[0] in present]


def format_edit_table(summaries: dict[str, dict]) -> str:
    """A markdown table (one row per variant, cells "edited (unedited)"), a chance line and the legend."""
    cols = _columns(summaries)
    header = ["variant", "known / records", *(h for _, _, h in cols), "paraphrases moved", "erased", "fluency"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, s in summaries.items():
        sets = s.get("sets", {})
        cells = [_pair(sets.get(kind, {}).get(metric)) for kind, metric, _ in cols]
        erased = "-" if s.get("erased") is None else f"{s['erased']:.2f}"
        lines.append(
            f"| {name} | {s['known']} / {s['records']} | "
            + " | ".join(cells)
            + f" | {_moved(s.get('paraphrase_moved'))} | {erased} | "
            + _pair(s.get("fluency"))
            + " |"
        )
    chance = []
    for kind in ("train", "heldout", "portability"):
        values = [s["sets"][kind]["new_greedy"]["chance"] for s in summaries.values() if kind in s.get("sets", {})]
        values = [v for v in values if v is not None]
        if values:
            chance.append(f"{kind} new greedy {values[0]:.3g}")
    by_length = {name: s["paraphrase_moved"]["by_length"] for name, s in summaries.items() if _split(s)}
    if by_length:
        lines += ["", "Paraphrases moved by the target name's length against the source's, in tokens:"]
        lines += [
            f"- {name}: " + ", ".join(f"{g} {_moved(e)}" for g, e in groups.items())
            for name, groups in by_length.items()
        ]
    unknown = [name for name, s in summaries.items() if not s["known"]]
    if unknown:
        lines += [
            "",
            f"No known records for {', '.join(unknown)}: nothing to edit, so no figures (see all_records "
            "in --json for the unfiltered values).",
        ]
    lines += [
        "",
        "Cells: edited (unedited). Chance: " + ", ".join(chance + ["P(new)>P(true) and P(own)>P(new) 0.5"]) + ".",
        "",
        "Legend:",
        *(f"- {k}: {v}" for k, v in LEGEND.items()),
    ]
    return "\n".join(lines)
