"""The report of the side-by-side experiment: one summary row per kind, the markdown table, and the plots.

`summarize_kind` turns one kind's raw results (training summary, held-out perplexity, lm-eval metrics, NIAH
grid) into a row; `markdown_table` lays rows out as OUT/report.md's table; `plot_report` draws
loss_vs_flops.png (training loss against cumulative training FLOPs, trainer held-out points as dots),
accuracy.png (bars per task and kind) and niah_<kind>.png heatmaps. Used by `stemlm.experiments.compare`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ACC_TASKS = ("stemlm_facts_capital", "stemlm_facts_language", "stemlm_facts_currency", "stemlm_cloze")


def summarize_kind(r: dict[str, Any]) -> dict[str, Any]:
    """The report row of one kind (accuracy = mean over the four accuracy tasks; ROI per PFLOP)."""
    accs = {t: r["tasks"].get(t, {}).get("acc") for t in ACC_TASKS}
    known = [a for a in accs.values() if a is not None]
    accuracy = sum(known) / len(known) if known else None
    return {
        "kind": r["kind"],
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


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The report table: one row per kind; ROI is also given relative to dense (or the first kind)."""
    lengths = list(rows[0]["niah_by_length"])
    ref = next((r for r in rows if r["kind"] == "dense"), rows[0])
    head = (
        [
            "kind",
            "params total",
            "params active",
            "train FLOPs/token",
            "steps",
            "train FLOPs",
            "held-out loss",
            "bits/byte",
        ]
        + [t.removeprefix("stemlm_").replace("facts_", "") + " acc" for t in ACC_TASKS]
        + ["mean acc"]
        + [f"NIAH@{n}" for n in lengths]
        + ["loss spikes", "ROI (acc/PFLOP)", "ROI vs " + ref["kind"], "tokens/s"]
    )
    fmt = lambda v, f="{:.3f}": "n/a" if v is None else f.format(v)  # noqa: E731
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        rel = (
            None
            if not (r["roi_acc_per_pflop"] and ref["roi_acc_per_pflop"])
            else (r["roi_acc_per_pflop"] / ref["roi_acc_per_pflop"])
        )
        cells = (
            [
                r["kind"],
                f"{r['params_total'] / 1e6:.3f}M",
                f"{r['params_active'] / 1e6:.3f}M",
                f"{r['train_flops_per_token']:.4g}",
                str(r["steps"]),
                f"{r['train_flops']:.4g}",
                fmt(r["heldout_loss"]),
                fmt(r["heldout_bpb"]),
            ]
            + [fmt(r["accuracy"][t]) for t in ACC_TASKS]
            + [fmt(r["mean_accuracy"])]
            + [fmt(r["niah_by_length"][n], "{:.2f}") for n in lengths]
            + [
                str(r["loss_spikes"]),
                fmt(r["roi_acc_per_pflop"], "{:.1f}"),
                fmt(rel, "{:.2f}x"),
                fmt(r["tokens_per_s"], "{:,.0f}"),
            ]
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_report(results: list[dict[str, Any]], out: Path) -> list[Path]:
    """loss_vs_flops.png, accuracy.png and one NIAH heatmap per kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from stemlm.evaluation.niah import plot_niah_heatmap
    from stemlm.train.logging import read_metrics

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        records = read_metrics(Path(r["fit"]["run_dir"]) / "metrics.jsonl")
        per_step = r["train_flops"] / max(1, r["fit"]["steps"])
        train = [(x["step"] * per_step, x["loss"]) for x in records if x.get("kind") == "train" and x.get("loss")]
        smooth = [
            sum(v for _, v in train[max(0, i - 9) : i + 1]) / len(train[max(0, i - 9) : i + 1])
            for i in range(len(train))
        ]
        line = ax.plot([f for f, _ in train], smooth, label=f"{r['kind']} (train, 10-step mean)")[0]
        evals = [
            (x["step"] * per_step, x["heldout_loss"])
            for x in records
            if x.get("kind") == "eval" and x.get("heldout_loss") is not None
        ]
        ax.plot([f for f, _ in evals], [v for _, v in evals], "o--", color=line.get_color(), markersize=3)
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("loss (nats/token); dots: trainer held-out")
    ax.set_title("loss vs training FLOPs")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths = [out / "loss_vs_flops.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        values = [r["tasks"].get(t, {}).get("acc") or 0.0 for t in ACC_TASKS]
        ax.bar([j + i * width for j in range(len(ACC_TASKS))], values, width, label=r["kind"])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ACC_TASKS))], [t.removeprefix("stemlm_") for t in ACC_TASKS])
    ax.axhline(0.25, color="grey", linestyle=":", linewidth=1)  # chance on the 4-way fact tasks
    ax.set_ylabel("accuracy")
    ax.set_title("lm-eval task accuracy (dotted: 4-way chance)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "accuracy.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    for r in results:
        paths.append(plot_niah_heatmap(r["niah"], out / f"niah_{r['kind']}.png", title=f"NIAH: {r['kind']}"))
    return paths
