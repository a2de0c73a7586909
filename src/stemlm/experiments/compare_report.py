"""The report of the side-by-side experiment: one summary row per kind and seed, the tables, and the plots.

`summarize_kind` turns one run's raw results (training summary, held-out perplexity, lm-eval metrics, NIAH grid)
into a row; `write_report` writes OUT/results.json and OUT/report.md (per match: the setup of every kind, the
results as mean ± 95% interval with per-seed values, the paired differences to the reference kind; then the lr
sweep); `plot_report` draws loss_vs_flops.png (training curves of every seed, and the held-out loss of the
table, from the same evaluation set, as mean ± interval with seed points), accuracy.png and niah_<kind>.png.
Used by `stemlm.experiments.compare`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stemlm.experiments.stats import format_ci, format_seeds

ACC_TASKS = ("stemlm_facts_capital", "stemlm_facts_language", "stemlm_facts_currency", "stemlm_cloze")


def summarize_kind(r: dict[str, Any]) -> dict[str, Any]:
    """The report row of one kind (accuracy = mean over the four accuracy tasks; ROI per PFLOP)."""
    accs = {t: r["tasks"].get(t, {}).get("acc") for t in ACC_TASKS}
    known = [a for a in accs.values() if a is not None]
    accuracy = sum(known) / len(known) if known else None
    return {
        "kind": r["kind"],
        "lr": r.get("lr"),
        "table_lr": r.get("table_lr"),
        "embed_lr": r.get("embed_lr"),
        "tokens": r.get("tokens"),
        "params_total": r["params_total"],
        "params_active": r["params_active"],
        "train_flops_per_token": r["train_flops_per_token"],
        "steps": r["steps"],
        "train_flops": r["train_flops"],
        "heldout_loss": r["heldout"]["loss"],
        "heldout_bpb": r["heldout"]["bits_per_byte"],
        "accuracy": accs,
        "mean_accuracy": accuracy,
        "niah_by_length": r["niah"]["by_length"],
        "niah": r["niah"]["accuracy"],
        "loss_spikes": r["fit"]["loss_spikes"],
        "tokens_per_s": r["fit"]["tokens_per_s"],
        "roi_acc_per_pflop": None if accuracy is None else accuracy / (r["train_flops"] / 1e15),
    }


def _get(d: Any, path: tuple) -> Any:
    for key in path:
        d = d.get(key) if isinstance(d, dict) else None
    return d


def _cell(report: dict, path: tuple, digits: int = 3) -> str:
    """mean ± half the 95% interval, then the per-seed values in brackets."""
    values = [_get(s, path) for s in report["per_seed"]]
    if all(v is None for v in values):
        return "n/a"
    return f"{format_ci(_get(report['summary'], path), digits)} ({format_seeds(values, digits)})"


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows]) + "\n"


def setup_table(report: dict, match: str) -> str:
    """Per kind: parameters, steps, tokens, training FLOPs and learning rates (the same in every seed)."""
    rows = []
    for kind, r in report["per_seed"][0][match].items():
        rows.append(
            [
                kind,
                f"{r['params_total'] / 1e6:.3f}M",
                f"{r['params_active'] / 1e6:.3f}M",
                r["steps"],
                f"{r['tokens']:,}",
                f"{r['train_flops']:.4g}",
                f"{r['lr']:g}",
                "-" if r["table_lr"] is None else f"{r['table_lr']:g}",
                f"{r['embed_lr']:g}",
            ]
        )
    head = ["kind", "params total", "params active", "steps", "tokens", "train FLOPs", "lr", "table lr", "embed lr"]
    return _table(head, rows)


def results_table(report: dict, match: str) -> str:
    """Per kind: every evaluation as mean ± h (per-seed values)."""
    first = report["per_seed"][0][match]
    lengths = list(next(iter(first.values()))["niah_by_length"])
    columns = {"held-out loss": ("heldout_loss",), "bits/byte": ("heldout_bpb",)}
    columns |= {t.removeprefix("stemlm_").replace("facts_", "") + " acc": ("accuracy", t) for t in ACC_TASKS}
    columns |= {"mean acc": ("mean_accuracy",)} | {f"NIAH@{n}": ("niah_by_length", n) for n in lengths}
    rows = [[kind, *(_cell(report, (match, kind, *p)) for p in columns.values())] for kind in first]
    return _table(["kind", *columns], rows)


def diff_table(report: dict, match: str) -> str:
    """Paired per-seed differences to the reference kind (and of each variant arm to its default arm), with how
    many seeds agree in sign."""
    rows = []
    for name in report["per_seed"][0]["diff"][match]:
        row = [name]
        for key in ("heldout_loss", "heldout_bpb", "mean_accuracy", "niah"):
            values = [_get(s, ("diff", match, name, key)) for s in report["per_seed"]]
            below, above = sum(v is not None and v < 0 for v in values), sum(v is not None and v > 0 for v in values)
            signs = f"<0 in {below}, >0 in {above}"
            row.append(f"{_cell(report, ('diff', match, name, key))}; {signs} of {len(values)}")
        rows.append(row)
    return _table(["kind - reference", "Δ held-out loss", "Δ bits/byte", "Δ mean acc", "Δ NIAH"], rows)


def write_report(report: dict, raw: list[dict[str, dict]], out: Path) -> list[Path]:
    """OUT/results.json, OUT/report.md and the plots; `raw` holds every seed's full run results."""
    cfg = report["config"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    plots = plot_report(report, raw, out)
    names = {"flops": "Matched training FLOPs", "tokens": "Matched training tokens"}
    parts = [
        f"# Side-by-side comparison, budget {cfg['budget']}, {len(report['per_seed'])} seed(s)\n",
        f"Every cell: mean ± half the 95% interval ({report['interval']}), then the per-seed values. "
        f"{EVAL_SET.format(tokens=cfg['ppl_tokens'], window=cfg['seq_len'])}; the plots show the same numbers. "
        f"lm-eval tasks: {cfg['eval_limit'] or 'all'} examples each (4-way fact tasks: chance 0.25). "
        f"Wall time {report['wall_s']:.0f} s.\n",
    ]
    for match in report["steps"]:
        parts += [
            f"## {names[match]}\n",
            setup_table(report, match),
            results_table(report, match),
            diff_table(report, match),
        ]
    sweep = report["sweep"]
    if sweep:
        rows = [
            [k, f"{t['lr']:g}", f"{t['heldout_loss']:.4f}", "yes" if t["lr"] == sweep["best"][k] else ""]
            for k, trials in sweep["trials"].items()
            for t in trials.values()
        ]
        parts += [
            f"## lr sweep (seed {sweep['seed']}, steps {sweep['steps']}, criterion: {sweep['criterion']})\n",
            _table(["kind", "lr", "validation loss", "chosen"], rows),
        ]
    else:
        parts += [f"No lr sweep: every kind at lr {cfg['lr']:g} (STEM tables and dense_embed's embedding x10).\n"]
    parts += ["".join(f"![{p.stem}]({p.name})\n" for p in plots)]
    (out / "report.md").write_text("\n".join(parts))
    return plots


EVAL_SET = (
    "Held-out loss (nats/token) and bits/byte: the embedded held-out split, first {tokens} tokens, window {window}"
)


def plot_report(report: dict, raw: list[dict[str, dict]], out: Path) -> list[Path]:
    """loss_vs_flops.png, accuracy.png and one NIAH heatmap per kind (first seed, first match)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from stemlm.evaluation.niah import plot_niah_heatmap
    from stemlm.train.logging import read_metrics

    cfg = report["config"]
    matches = list(report["steps"])
    kinds = list(report["per_seed"][0][matches[0]])
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {k: f"C{i}" for i, k in enumerate(kinds)}
    for seed_runs in raw:
        for r in seed_runs.values():
            records = read_metrics(Path(r["fit"]["run_dir"]) / "metrics.jsonl")
            per_step = r["train_flops"] / max(1, r["fit"]["steps"])
            train = [(x["step"] * per_step, x["loss"]) for x in records if x.get("kind") == "train" and x.get("loss")]
            smooth = [
                sum(v for _, v in train[max(0, i - 9) : i + 1]) / len(train[max(0, i - 9) : i + 1])
                for i in range(len(train))
            ]
            ax.plot([f for f, _ in train], smooth, color=colors[r["kind"]], alpha=0.35, linewidth=0.8)
    for match, marker in zip(matches, ("o", "s"), strict=False):
        for kind in kinds:
            entry = _get(report["summary"], (match, kind, "heldout_loss")) or {}
            flops = report["per_seed"][0][match][kind]["train_flops"]
            values = [_get(s, (match, kind, "heldout_loss")) for s in report["per_seed"]]
            ax.scatter([flops] * len(values), values, s=10, color=colors[kind], marker=marker, alpha=0.6)
            if entry.get("mean") is not None:
                lo, hi = entry["ci95"]
                err = None if lo is None else [[entry["mean"] - lo], [hi - entry["mean"]]]
                ax.errorbar(
                    [flops],
                    [entry["mean"]],
                    yerr=err,
                    fmt=marker,
                    color=colors[kind],
                    capsize=4,
                    label=f"{kind} ({match}-matched)",
                )
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(
        "lines: training loss (10-step mean, every seed); markers: held-out loss, mean ± 95% CI and seeds\n"
        + EVAL_SET.format(tokens=cfg["ppl_tokens"], window=cfg["seq_len"]),
        fontsize=8,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths = [out / "loss_vs_flops.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(kinds)
    for i, kind in enumerate(kinds):
        xs = [j + i * width for j in range(len(ACC_TASKS))]
        for j, t in enumerate(ACC_TASKS):
            entry = _get(report["summary"], (matches[0], kind, "accuracy", t)) or {}
            values = [_get(s, (matches[0], kind, "accuracy", t)) for s in report["per_seed"]]
            ax.scatter([xs[j]] * len(values), values, s=8, color="black", zorder=3)
            if entry.get("mean") is not None:
                lo, hi = entry["ci95"]
                err = None if lo is None else [[entry["mean"] - lo], [hi - entry["mean"]]]
                ax.bar(
                    [xs[j]],
                    [entry["mean"]],
                    width,
                    yerr=err,
                    capsize=3,
                    color=colors[kind],
                    label=kind if j == 0 else None,
                )
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ACC_TASKS))], [t.removeprefix("stemlm_") for t in ACC_TASKS])
    ax.axhline(0.25, color="grey", linestyle=":", linewidth=1)
    ax.set_ylabel("accuracy")
    ax.set_title(
        f"lm-eval accuracy, {matches[0]}-matched: mean ± 95% CI, dots: seeds (dotted: 4-way chance)", fontsize=9
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "accuracy.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    first = raw[0]
    for kind in kinds:
        r = first[f"{kind}-{report['steps'][matches[0]][kind]}steps"]
        title = f"NIAH: {kind} (seed {report['per_seed'][0]['seed']}, {matches[0]}-matched)"
        paths.append(plot_niah_heatmap(r["niah"], out / f"niah_{kind}.png", title=title))
    return paths
