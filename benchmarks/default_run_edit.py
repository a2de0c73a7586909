"""The default run over seeds, with the controls that show what its STEM tables carry (docs/results.md "The default
run"): per seed, `stemlm train` as the quick start runs it (plus any `--set`), then the README's edit
(`stemlm edit RUN --prompt "The capital of Spain is" --source Spain --target Germany`) with each row kind
(`--rows tables` is the command's default; `embed` and `both` are the controls), then `stemlm eval edits` over
the seeds (held-out paraphrases), and with `--dense` a dense model of the same training FLOPs and the same data
(`--ffn dense`, its steps cut to the STEM run's FLOPs) edited through its embedding rows.

    python benchmarks/default_run_edit.py --seeds 0,1,2,3,4 --dense --out runs/default-seeds
    python benchmarks/default_run_edit.py --seeds 0,1 --set train.fact_fraction=0.5 --out runs/facts50

Every command runs in a subprocess at one thread (`--threads 1`, OMP_NUM_THREADS=1); a run whose report is already
in `--out` is reused, so a longer seed list extends an earlier one. Printed: a row per run (held-out loss, recall,
spike lines, the edit's P(target's first token) and its ratio to the runner-up for each row kind), then the eval
edits summary per row kind (paraphrases moved with its 95% interval over seeds, locality), then the held-out loss
difference STEM - dense paired by seed.

Last line: `RESULT seeds=N tables_ratio_min=... tables_berlin=K/N paraphrase_tables=... paraphrase_tables_lo=...
locality_tables=... spikes_max=... stem_minus_dense=...`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

EDIT = ("The capital of Spain is", "Spain", "Germany", " Berlin")  # the README's edit and the answer it moves to
ROWS = ("tables", "embed", "both")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="stemlm train --set overrides")
    p.add_argument("--train-args", default="", help="further stemlm train arguments, one string")
    p.add_argument("--dense", action="store_true", help="also train and edit the same-FLOPs dense control")
    p.add_argument("--out", required=True, help="folder of the runs and their records (reused on rerun)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    return p.parse_args(argv)


def stemlm(*args: str) -> dict[str, Any]:
    """`stemlm ARGS --json` at one thread: its JSON object, or exit with its stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    exe = Path(sys.executable).with_name("stemlm")
    done = subprocess.run([str(exe), *args, "--json"], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"stemlm {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def train(run: Path, seed: int, extra: list[str]) -> dict[str, Any]:
    """The run's train report (trained now, or read back from an earlier invocation)."""
    record = run / "report.json"
    if record.is_file():
        return json.loads(record.read_text())
    report = stemlm("train", "--out", str(run), "--seed", str(seed), "--threads", "1", "--no-progress", *extra)
    record.write_text(json.dumps(report))
    return report


def edit(run: Path, rows: str) -> dict[str, float]:
    """P(the answer's first token) after the README's edit with `rows`, the runner-up's, and their ratio."""
    prompt, source, target, answer = EDIT
    out = stemlm("edit", str(run), "--prompt", prompt, "--source", source, "--target", target, "--rows", rows)
    top = out["after"]["top_k"]
    first = next((t for t in top if answer.startswith(t["token"]) and t["token"].strip()), None)
    p = first["prob"] if first else 0.0
    runner = max(t["prob"] for t in top if t is not first)
    return {"p": p, "runner_up": runner, "ratio": p / runner, "answer": out["after"]["completion"]}


def dense_steps(run: Path, stem_report: dict[str, Any]) -> int:
    """Steps of the dense control whose training FLOPs equal the STEM run's (stemlm's own accounting of the run's
    model with every FFN dense, at the run's sequence length)."""
    from stemlm.model.accounting import summarize
    from stemlm.model.config import ModelConfig

    config = ModelConfig.from_dict(json.loads((Path(stem_report["checkpoint"]) / "config.json").read_text()))
    seq_len = json.loads((run / "run_config.json").read_text())["train"]["seq_len"]
    dense_per_token = summarize(config.replace(ffn="dense"), seq_len)["flops"]["training_per_token"]
    stem_flops = stem_report["accounting"]["training_flops_per_token"] * stem_report["tokens_seen"]
    return math.floor(stem_flops / (dense_per_token * stem_report["tokens_seen"] / stem_report["steps"]))


def mean_ci(values: list[float]) -> tuple[float, float, float]:
    from stemlm.experiments.stats import mean_ci95

    ci = mean_ci95(values)
    low, high = ci["ci95"]
    return ci["mean"], low, high


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = [*args.train_args.split(), *(["--set", *args.set] if args.set else [])]
    runs: dict[str, dict[int, Any]] = {"stem": {}, "dense": {}}
    for seed in seeds:
        report = train(out / f"stem-seed{seed}", seed, extra)
        row = {"report": report, **{rows: edit(out / f"stem-seed{seed}", rows) for rows in ROWS}}
        runs["stem"][seed] = row
        if args.dense:
            steps = dense_steps(out / f"stem-seed{seed}", report)
            dense = train(out / f"dense-seed{seed}", seed, [*extra, "--ffn", "dense", "--steps", str(steps)])
            runs["dense"][seed] = {"report": dense, "embed": edit(out / f"dense-seed{seed}", "embed")}
    stem_runs = [str(out / f"stem-seed{s}") for s in seeds]
    edits = stemlm("eval", "edits", *stem_runs, "--fluency-tokens", "0")
    dense_edits = None
    if args.dense:
        dense_runs = [str(out / f"dense-seed{s}") for s in seeds]
        dense_edits = stemlm("eval", "edits", *dense_runs, "--fluency-tokens", "0", "--variants", "embed")
    summary = summarize(runs, edits, dense_edits, seeds)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if args.json:
        print(json.dumps(summary))
        return 0
    print_summary(summary)
    return 0


def summarize(runs: dict[str, Any], edits: dict[str, Any], dense_edits: dict[str, Any] | None, seeds: list[int]):
    rows = []
    for arm in ("stem", "dense"):
        for seed, r in runs[arm].items():
            rep = r["report"]
            facts = rep.get("facts", {})
            rows.append(
                {
                    "arm": arm,
                    "seed": seed,
                    "heldout_loss": rep["heldout_loss"],
                    "tflop": rep["accounting"]["training_flops_per_token"] * rep["tokens_seen"] / 1e12,
                    "recall_train": facts.get("train_templates", {}).get("recall"),
                    "recall_heldout": facts.get("heldout_templates", {}).get("recall"),
                    "spikes": rep.get("loss_spikes"),
                    "tokens_per_s": rep.get("tokens_per_s"),
                    "sample": rep.get("sample", {}).get("completion"),
                    "edit": {rows: r[rows] for rows in ROWS if rows in r},
                }
            )
    summary: dict[str, Any] = {"seeds": seeds, "runs": rows, "eval_edits": {}}
    for name, result in (("stem", edits), ("dense", dense_edits)):
        if result is None:
            continue
        each = result.get("checkpoints", [result])
        for rows_kind in each[0]["variants"]:
            per = [c["variants"][rows_kind] for c in each]
            moved = result.get("paraphrase_moved", {}).get(rows_kind) or {
                "mean": per[0]["paraphrase_moved"]["rate"],
                "ci95": [None, None],
                "rates": [per[0]["paraphrase_moved"]["rate"]],
            }
            summary["eval_edits"][f"{name}/{rows_kind}"] = {
                "paraphrase_moved": moved,
                "counts": [(v["paraphrase_moved"]["moved"], v["paraphrase_moved"]["known"]) for v in per],
                # None where the model knows no record (nothing edited to probe locality after)
                "locality_other": [
                    v["sets"].get("locality_other", {}).get("kept_greedy", {}).get("edited") for v in per
                ],
                "by_length": [v["paraphrase_moved"].get("by_length") for v in per],
            }
    stem = {r["seed"]: r for r in rows if r["arm"] == "stem"}
    dense = {r["seed"]: r for r in rows if r["arm"] == "dense"}
    diffs = [stem[s]["heldout_loss"] - dense[s]["heldout_loss"] for s in seeds if s in dense]
    summary["stem_minus_dense"] = mean_ci(diffs) if len(diffs) > 1 else (diffs[0] if diffs else None)
    return summary


def number(x: float | None) -> str:
    """A figure of the RESULT line: 3 decimals, or "none" where nothing was measured (no known record)."""
    return "none" if x is None or x != x else f"{x:.3f}"


def print_summary(summary: dict[str, Any]) -> None:
    print("arm    seed  held-out  TFLOP  recall tr/ho  spikes  " + "  ".join(f"{r:>16}" for r in ROWS) + "  sample")
    for r in summary["runs"]:
        cells = "  ".join(
            f"{r['edit'][k]['p']:.3f}/{r['edit'][k]['runner_up']:.3f}".rjust(16) if k in r["edit"] else " " * 16
            for k in ROWS
        )
        sample = (r["sample"] or "").replace("\n", " | ")[:60]
        print(
            f"{r['arm']:<6} {r['seed']:>4}  {r['heldout_loss']:.4f}  {r['tflop']:.2f}  "
            f"{r['recall_train']:.2f} / {r['recall_heldout']:.2f}  {r['spikes']:>6}  {cells}  {sample!r}"
        )
    for name, e in summary["eval_edits"].items():
        m = e["paraphrase_moved"]
        print(
            f"eval edits {name}: paraphrases moved mean {m['mean']} 95% {m['ci95']} per seed {m['rates']} "
            f"(moved/known {e['counts']}); locality {e['locality_other']}; by length {e['by_length']}"
        )
    d = summary["stem_minus_dense"]
    print(f"held-out loss, STEM - dense paired by seed: {d}")
    stem = [r for r in summary["runs"] if r["arm"] == "stem"]
    ratios = [r["edit"]["tables"]["ratio"] for r in stem]
    moved = summary["eval_edits"]["stem/tables"]["paraphrase_moved"]
    locality = [x for x in summary["eval_edits"]["stem/tables"]["locality_other"] if x is not None] or [float("nan")]
    print(
        f"RESULT seeds={len(stem)} tables_ratio_min={min(ratios):.2f} "
        f"tables_berlin={sum(x >= 10 for x in ratios)}/{len(stem)} paraphrase_tables={number(moved['mean'])} "
        f"paraphrase_tables_lo={number(moved['ci95'][0])} locality_tables={number(min(locality))} "
        f"spikes_max={max(r['spikes'] for r in stem)} stem_minus_dense={number(d[0] if isinstance(d, tuple) else d)}"
    )


if __name__ == "__main__":
    sys.exit(main())
