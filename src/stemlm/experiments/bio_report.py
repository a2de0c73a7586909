"""results.md of the biography experiment: mean ± 95% interval over seeds beside the per-seed values.

from stemlm.experiments.bio_report import markdown
Path("results.md").write_text(markdown(results))      # results: stemlm.experiments.bio.run_bio's dict
"""

from __future__ import annotations

from stemlm.data.worlds.bio import ATTRIBUTES
from stemlm.experiments.stats import format_ci, format_seeds

KINDS = ("dense", "stem")
ROWS = (
    ("memorisation", "acc", "memorisation: biography sentences, all people"),
    ("memorisation_heldout_people", "acc", "memorisation: biography sentences, held-out half"),
    ("qa_trained_people", "acc", "QA, QA-trained half (in distribution)"),
    ("extraction", "acc", "**extraction**: QA, held-out half, trained phrasings"),
    ("extraction_heldout_phrasing", "acc", "extraction: QA, held-out half, held-out phrasing"),
    ("bits_per_param", None, "knowledge bits / total parameter"),
    ("bits_per_active_param", None, "knowledge bits / active parameter"),
)


def _cell(results: dict, kind: str, key: str, sub: str | None, digits: int = 3) -> str:
    entry = results["summary"].get(kind, {}).get(key)
    entry = entry.get(sub) if sub and entry else entry
    values = [s[kind][key][sub] if sub else s[kind][key] for s in results["per_seed"]]
    return f"{format_ci(entry, digits)} [{format_seeds(values, digits)}]"


def markdown(results: dict) -> str:
    cfg, per_seed = results["config"], results["per_seed"]
    first = per_seed[0]
    lines = [
        "# Biography world: memorisation vs extraction, dense vs STEM at matched training FLOPs",
        "",
        f"{cfg['people']} people ({cfg['people'] // 2} with QA in training, the rest held out), "
        f"{cfg['bios_per_person']} biographies each, {cfg['qa_repeats']} QA documents per QA-trained person; "
        f"{results['seeds']} seeds; wall {results['wall_s']:.0f} s. Cells: mean ± half the 95% interval "
        "(Student t over seeds) [per-seed values]. Exact greedy match of the full answer.",
        "",
        "| | " + " | ".join(KINDS) + " |",
        "|---|" + "---|" * len(KINDS),
    ]
    for key in ("steps", "tokens", "train_flops", "params_total", "params_active"):
        lines.append(f"| {key} | " + " | ".join(f"{first[k][key]:.4g}" for k in KINDS) + " |")
    lines.append(f"| lr (tables) | {cfg['lr']} | {cfg['lr']} ({cfg['lr'] * 10:g}: trainer default x10) |")
    for key, sub, label in ROWS:
        lines.append(f"| {label} | " + " | ".join(_cell(results, k, key, sub) for k in KINDS) + " |")
    chance = results["summary"]["chance"]["mean"]
    lines += [
        f"| chance (name-blind best constant answer, held-out half) | {format_ci(chance)} | |",
        "",
        "## Extraction per attribute (QA on the held-out half, trained phrasings)",
        "",
        "| attribute | chance | " + " | ".join(KINDS) + " |",
        "|---|---|" + "---|" * len(KINDS),
    ]
    for a in ATTRIBUTES:
        cells = " | ".join(_cell(results, k, "extraction", a) for k in KINDS)
        lines.append(f"| {a} | {format_ci(results['summary']['chance'][a])} | {cells} |")
    lines += [
        "",
        "Knowledge bits (part 3.3 of Physics of Language Models): per attribute max(0, N·log2 K − the model's "
        "loss in bits on the values after the first biography template), summed; the most there is to learn is "
        f"{first['dense']['knowledge_bits']['entropy']:.0f} bits per seed. Active parameters exclude the STEM "
        "tables (the paper's convention).",
        "",
    ]
    return "\n".join(lines)
