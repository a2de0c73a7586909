"""The knowledge experiment's report: OUT/results.json, OUT/results.md (tables) and OUT/knowledge.png.

Every figure is a mean ± half the 95% interval over seeds (Student t, `stemlm.experiments.stats`) followed by
the per-seed values in brackets. Tables: the setup of each arm (parameters, steps, tokens, FLOPs, lrs), the
matched-FLOPs and matched-tokens comparisons, the paired STEM - dense differences with how many seeds agree in
sign, the lr sweep, and the edits. Used by `stemlm.experiments.knowledge`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stemlm.edit.report import COLUMNS as EDIT_COLUMNS
from stemlm.edit.report import LEGEND as EDIT_LEGEND
from stemlm.experiments.stats import format_ci, format_seeds

METRICS = {  # column -> path inside an arm's per-seed entry
    "held-out loss": ("heldout_loss",),
    "train loss": ("train_loss",),
    "recall (train tpl)": ("recall", "train", "recall"),
    "recall (held-out tpl)": ("recall", "heldout", "recall"),
}


def _cell(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else "-" if value is None else str(value)


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows])


def _get(d: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        d = d.get(key) if isinstance(d, dict) else None
    return d


def seed_cell(results: dict, path: tuple[str, ...], digits: int = 3) -> str:
    """ "mean ± h (s0 / s1 / ...)" of the per-seed values at `path` (the summary holds the same path)."""
    values = [_get(s, path) for s in results["per_seed"]]
    if all(v is None for v in values):
        return "n/a"
    return f"{format_ci(_get(results['summary'], path), digits)} ({format_seeds(values, digits)})"


def setup_table(results: dict) -> str:
    arms = results["per_seed"][0]["arms"]
    rows = [
        [
            arm,
            f"{r['params_total'] / 1e6:.3f}M",
            f"{r['params_active'] / 1e6:.3f}M",
            r["steps"],
            r["tokens"],
            f"{r['train_flops']:.3g}",
            f"{r['lr']:g}",
            "-" if r["table_lr"] is None else f"{r['table_lr']:g}",
            f"{r['embed_lr']:g}",
        ]
        for arm, r in arms.items()
    ]
    header = ["arm", "params total", "params active", "steps", "tokens", "train FLOPs", "lr", "table lr", "embed lr"]
    return markdown_table(header, rows)


def comparison_table(results: dict, arms: list[str]) -> str:
    present = [a for a in arms if a in results["per_seed"][0]["arms"]]
    rows = [[a, *(seed_cell(results, ("arms", a, *path)) for path in METRICS.values())] for a in present]
    return markdown_table(["arm", *METRICS], rows)


def contrast_table(results: dict) -> str:
    rows = []
    for name in results["per_seed"][0]["diff"]:
        row = [name]
        for key in ("heldout_loss", "recall_train", "recall_heldout"):
            values = [s["diff"][name][key] for s in results["per_seed"]]
            below = sum(v < 0 for v in values)
            above = sum(v > 0 for v in values)
            row.append(f"{seed_cell(results, ('diff', name, key))}; <0 in {below}, >0 in {above} of {len(values)}")
        rows.append(row)
    return markdown_table(["contrast", "Δ held-out loss", "Δ recall (train tpl)", "Δ recall (held-out tpl)"], rows)


def sweep_table(sweep: dict) -> str:
    rows = [
        [
            family,
            t["lr"],
            t["heldout_loss"],
            t["recall_train"],
            t["recall_heldout"],
            "yes" if t["lr"] == sweep["best"][family] else "",
        ]
        for family, trials in sweep["trials"].items()
        for t in trials.values()
    ]
    return markdown_table(
        ["lr family", "lr", "held-out loss", "recall (train tpl)", "recall (held-out tpl)", "chosen"], rows
    )


def edit_table(results: dict, path: tuple[str, ...]) -> str:
    """One row per variant under `path` (e.g. ("edits", "variants")): known records, then each edit metric of
    `stemlm.edit.report.COLUMNS` as edited mean ± h (per seed) [unedited mean], then erased."""
    names = _get(results["per_seed"][0], path) or {}
    present = {k for v in names.values() if isinstance(v, dict) for k in v.get("sets", {})}
    columns = [c for c in EDIT_COLUMNS if c[0] in present]
    rows = []
    for name, first in names.items():
        row = [name, f"{seed_cell(results, (*path, name, 'known'), 1)} / {first['records']}"]
        for kind, metric, _ in columns:
            where = (*path, name, "sets", kind, metric)
            unedited = format_ci(_get(results["summary"], (*where, "unedited")), 2)
            row.append(f"{seed_cell(results, (*where, 'edited'), 2)} [unedited {unedited}]")
        row.append(seed_cell(results, (*path, name, "erased"), 2))
        rows.append(row)
    return markdown_table(["variant", "known / records", *(h for _, _, h in columns), "erased"], rows)


def edit_notes(results: dict) -> list[str]:
    """The chance levels of the edit metrics (from the first seed's first variant) and the legend."""
    variants = results["per_seed"][0]["edits"]["variants"]
    chance = []
    for kind in ("train", "heldout", "portability"):
        values = [_get(v, ("sets", kind, "new_greedy", "chance")) for v in variants.values()]
        values = [c for c in values if c is not None]
        if values:
            chance.append(f"{kind} new greedy {values[0]:.3g}")
    return [
        "Cells: edited, mean ± h (per seed) [unedited mean ± h]; every metric over the records the model knows. "
        "Chance: " + ", ".join(chance + ["P(new)>P(true) 0.5"]) + ".",
        "",
        *(f"- {k}: {v}" for k, v in EDIT_LEGEND.items()),
        "",
    ]


def write_report(results: dict, out: Path) -> None:
    """OUT/results.json (everything), OUT/results.md (the tables) and OUT/knowledge.png."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    cfg = results["config"]
    n = len(results["per_seed"])
    parts = [
        "# Knowledge experiment: dense vs STEM over seeds, at matched FLOPs and matched tokens",
        "",
        f"{n} seed(s) ({', '.join(str(s['seed']) for s in results['per_seed'])}); wall time "
        f"{results['wall_s']:.0f} s. Every cell: mean ± half the 95% interval ({results['interval']}), then the "
        "per-seed values. Recall is exact greedy continuation of the answer; its chance level (uniform guess "
        f"among the relation's answers) is {results['recall_chance']:.3f}. Held-out loss: the trainer's held-out "
        "split (natural text, the file's last 10%), nats/token.",
        "",
        "## Arms (identical in every seed)",
        "",
        setup_table(results),
        "",
        "## Matched training FLOPs (dense reference vs STEM)",
        "",
        comparison_table(results, ["dense", "stem"]),
        "",
        "## Matched training tokens (dense, STEM, and dense with its embedding at the tables' lr and wd)",
        "",
        comparison_table(results, ["dense", "stem_tokens", "dense_embed"]),
        "",
        "## Paired differences per seed (first arm minus second)",
        "",
        contrast_table(results),
        "",
    ]
    if results["sweep"]:
        parts += [
            f"## lr sweep (seed {results['sweep']['seed']}, chosen by {results['sweep']['criterion']})",
            "",
            sweep_table(results["sweep"]),
            "",
        ]
    else:
        parts += [f"No lr sweep: every arm at lr {cfg['lr']:g} (tables and dense_embed's embedding at x10).", ""]
    if "edits" in results["per_seed"][0]:
        edits = results["per_seed"][0]["edits"]
        parts += [
            f"## Positional edits ({edits['records']} {cfg['edit_relation']} records per seed)",
            "",
            edit_table(results, ("edits", "variants")),
            "",
            *edit_notes(results),
            "## The STEM model's edits by name lengths (1->1: both names single tokens)",
            "",
            edit_table(results, ("edits", "by_length")),
            "",
        ]
        if "diagnostics" in edits:
            parts += [
                "## Diagnostics: one STEM layer at a time",
                "",
                edit_table(results, ("edits", "diagnostics", "layers")),
                "",
                "## Length mismatch strategies (STEM rows)",
                "",
                edit_table(results, ("edits", "diagnostics", "mismatch")),
                "",
            ]
    parts += ["![knowledge](knowledge.png)", ""]
    (out / "results.md").write_text("\n".join(parts))
    plot(results, out / "knowledge.png")


def plot(results: dict, path: Path) -> Path:
    """Three panels (held-out loss, recall on training / held-out templates): per arm the mean with its 95%
    interval as an error bar, and every seed's value as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(results["per_seed"][0]["arms"])
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    panels = [("held-out loss (nats/token)", ("heldout_loss",))] + [
        (name, p) for name, p in METRICS.items() if name.startswith("recall")
    ]
    for ax, (title, p) in zip(axes, panels, strict=True):
        for i, arm in enumerate(arms):
            entry = _get(results["summary"], ("arms", arm, *p)) or {}
            values = [_get(s, ("arms", arm, *p)) for s in results["per_seed"]]
            ax.scatter([i + 0.15] * len(values), values, s=12, color="grey", zorder=3)
            if entry.get("mean") is not None:
                lo, hi = entry["ci95"]
                err = None if lo is None else [[entry["mean"] - lo], [hi - entry["mean"]]]
                ax.errorbar([i], [entry["mean"]], yerr=err, fmt="o", capsize=4)
        if title.startswith("recall"):
            ax.axhline(results["recall_chance"], color="grey", linestyle=":", linewidth=1)
        ax.set_xticks(range(len(arms)), arms, rotation=20)
        ax.set_title(title, fontsize=10)
    fig.suptitle(
        f"mean ± 95% interval over {len(results['per_seed'])} seeds (t); grey dots: seeds; dotted: recall chance",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
