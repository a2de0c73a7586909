"""Held-out loss and fact recall of the table optimizers over seeds, at one training budget (decides the default).

Budgets (`--budget`):
- `main`: the default `stemlm train` run, i.e. `TrainConfig()` defaults (tiny STEM preset, today 200 steps of
  8 x 128 tokens, half of them the fact world's capital statements; the figures in the README were measured at
  the earlier default, 300 steps of 8 x 256, 30% facts) with only `seed` and `table_optim` changed;
  recall is the train report's (exact greedy recall on the trained templates and on held-out phrasings).
- `knowledge`: the STEM arm of `stemlm experiment knowledge` at its full default budget (`KnowledgeConfig()`:
  d 128, 4 layers, STEM in layers 1 and 3, the dense run's FLOPs, 16 x 64 tokens per step, the per-seed fact
  world + corpus file and BPE), at the experiment's no-sweep lr (`KnowledgeConfig.lr`); recall is the
  experiment's `fact_recall`.
The seed sets the initialisation and the data windows (and, for `knowledge`, the corpus slice and tokenizer).
Held-out loss is evaluated only at the end (`eval_every=0`: the evaluation consumes no training randomness).
Each (optimizer, seed) run trains in a worker process with one torch thread; `--workers 2` runs two at a time.
With `--out DIR` every finished run is kept as DIR/<budget>-<optim>-seed<s>.json and reused when the same
command (or one with more optimizers or seeds) is run again, and the summary is written to DIR/summary.json.

Printed: every run, then per optimizer the mean and 95% interval over seeds, and the paired difference against
the first optimizer per seed with its mean and Student-t 95% interval (`stemlm.experiments.stats`).

    OMP_NUM_THREADS=1 python benchmarks/table_optim_seeds.py --budget main --workers 2 --out runs/topt
    python benchmarks/table_optim_seeds.py --budget knowledge --optims rowwise_adagrad,lazy_adamw,adamw --json

Last line (without --json): `RESULT budget=<b> best=<optimizer> <name>_mean=... <name>_minus_<first>=...`
(lower held-out loss is better); `--json` prints the summary as one JSON object instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

BUDGETS = ("main", "knowledge")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", choices=BUDGETS, default="main", help="main (default stemlm train) or knowledge")
    p.add_argument(
        "--optims",
        default="rowwise_adagrad,lazy_adamw",
        help="comma-separated table optimizers; differences are taken against the first",
    )
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the budget's)")
    p.add_argument("--workers", type=int, default=1, help="runs trained at once, one thread each (default 1)")
    p.add_argument("--out", default=None, help="folder keeping each finished run's record (reused on rerun)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    args = p.parse_args(argv)
    from stemlm.placement.table_optim import TABLE_OPTIMIZERS

    args.optims = [o for o in args.optims.split(",") if o]
    bad = [o for o in args.optims if o not in TABLE_OPTIMIZERS]
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if bad or not args.optims:
        p.error(f"--optims must name table optimizers from {', '.join(TABLE_OPTIMIZERS)}, got {bad or 'none'}")
    if not args.seeds or len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        p.error("--seeds must be distinct non-negative integers")
    if (args.steps is not None and args.steps < 1) or args.workers < 1:
        p.error("--steps and --workers must be positive")
    return args


# ----- one run (in a worker process) -----
def knowledge_job(seed: int, steps: int | None, folder: Path) -> dict[str, Any]:
    """The knowledge experiment's STEM arm at `seed`: model config, TrainConfig fields, tokenizer (built once per
    seed in the parent, so every optimizer trains on the same file and BPE)."""
    from stemlm.experiments.knowledge import KnowledgeConfig, arm_plan, build_data, model_configs

    kcfg = dataclasses.replace(KnowledgeConfig(), seed=seed)
    tokenizer, data = build_data(kcfg, folder / f"knowledge-data-seed{seed}")
    configs = model_configs(kcfg)
    plan = arm_plan(kcfg, configs)["stem"]
    fields = dict(
        data=[str(data)],
        seq_len=kcfg.seq_len,
        batch_size=kcfg.batch_size,
        steps=steps or plan["steps"],
        lr=kcfg.lr,
        **plan["overrides"],
    )
    return {
        "model": configs["stem"].to_dict(),
        "fields": fields,
        "tokenizer": tokenizer.to_str(),
        "relations": list(kcfg.relations),
    }


def train_one(budget: str, optim: str, seed: int, steps: int | None, job: dict | None, out: str) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    from stemlm.train import TrainConfig, Trainer

    common = dict(seed=seed, table_optim=optim, out=out, eval_every=0, device="cpu", threads=1)
    if budget == "main":
        cfg = TrainConfig(**common, **({"steps": steps} if steps else {}))
        trainer = Trainer(None, cfg, progress=False)
        fit = trainer.fit()
        from stemlm.train.report import trained_fact_recall

        facts = trained_fact_recall(trainer)
        recall = {s: facts[f"{s}_templates"]["recall"] for s in ("train", "heldout")}
    else:
        from tokenizers import Tokenizer

        from stemlm.evaluation.recall import fact_recall
        from stemlm.model.config import ModelConfig

        tokenizer = Tokenizer.from_str(job["tokenizer"])
        trainer = Trainer(
            ModelConfig.from_dict(job["model"]),
            TrainConfig(**common, **job["fields"]),
            tokenizer=tokenizer,
            progress=False,
        )
        fit = trainer.fit()
        facts = fact_recall(trainer.model.eval(), tokenizer, tuple(job["relations"]))
        recall = {s: facts[s]["recall"] for s in ("train", "heldout")}
    shutil.rmtree(out, ignore_errors=True)  # only the record is kept (a tiny run folder is ~0.2 GB)
    return {
        "budget": budget,
        "optim": optim,
        "seed": seed,
        "steps": fit["steps"],
        "tokens": fit["tokens_seen"],
        "heldout_loss": fit["heldout_loss"],
        "train_loss": fit["train_loss"],
        "recall_train": recall["train"],
        "recall_heldout": recall["heldout"],
        "skipped_steps": fit["skipped_steps"],
        "train_time_s": fit["train_time_s"],
    }


# ----- the comparison -----
def summarize(records: dict[tuple[str, int], dict], optims: list[str], seeds: list[int]) -> dict[str, Any]:
    """Per optimizer: mean_ci95 of each metric over seeds; per other optimizer: the paired differences against
    optims[0] per seed (only seeds where both ran) with their mean_ci95."""
    from stemlm.experiments.stats import mean_ci95

    metrics = ("heldout_loss", "recall_train", "recall_heldout")
    base = optims[0]
    out: dict[str, Any] = {"optims": optims, "seeds": seeds, "per_optim": {}, "paired": {}}
    for name in optims:
        runs = [records[(name, s)] for s in seeds if (name, s) in records]
        out["per_optim"][name] = {
            m: {**mean_ci95(r[m] for r in runs), "per_seed": {r["seed"]: r[m] for r in runs}} for m in metrics
        }
    for name in optims[1:]:
        both = [s for s in seeds if (name, s) in records and (base, s) in records]
        diffs = {m: {s: records[(name, s)][m] - records[(base, s)][m] for s in both} for m in metrics}
        out["paired"][f"{name}-{base}"] = {m: {**mean_ci95(d.values()), "per_seed": d} for m, d in diffs.items()}
    done = [name for name in optims if out["per_optim"][name]["heldout_loss"]["n"]]
    out["best"] = min(done, key=lambda n: out["per_optim"][n]["heldout_loss"]["mean"]) if done else None
    return out


def _ci(entry: dict, digits: int = 4) -> str:
    from stemlm.experiments.stats import format_ci

    return format_ci(entry, digits) + f" (n={entry['n']})"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    keep = Path(args.out) if args.out else None
    if keep:
        keep.mkdir(parents=True, exist_ok=True)
    records: dict[tuple[str, int], dict] = {}
    log = sys.stderr if args.json else sys.stdout
    with tempfile.TemporaryDirectory(prefix="topt-") as tmp:
        jobs = []
        knowledge = {}
        for seed in args.seeds:  # interleaved by seed, so machine load hits the optimizers alike
            for name in args.optims:
                path = keep / f"{args.budget}-{name}-seed{seed}.json" if keep else None
                if path and path.is_file():
                    rec = json.loads(path.read_text())
                    if args.steps is not None and rec["steps"] != args.steps:  # never overwrite another budget's run
                        print(
                            f"{path} holds a {rec['steps']}-step run, not {args.steps}; choose another --out",
                            file=sys.stderr,
                        )
                        raise SystemExit(2)
                    records[(name, seed)] = rec
                    print(f"seed {seed} {name:<16} reused {path}", file=log, flush=True)
                    continue
                if args.budget == "knowledge" and seed not in knowledge:
                    knowledge[seed] = knowledge_job(seed, args.steps, Path(tmp))
                jobs.append((args.budget, name, seed, args.steps, knowledge.get(seed), f"{tmp}/{name}-{seed}"))
        with ProcessPoolExecutor(max_workers=args.workers, mp_context=get_context("spawn")) as pool:
            futures = [pool.submit(train_one, *job) for job in jobs]
            for fut in futures:
                rec = fut.result()
                records[(rec["optim"], rec["seed"])] = rec
                if keep:
                    (keep / f"{args.budget}-{rec['optim']}-seed{rec['seed']}.json").write_text(json.dumps(rec))
                print(
                    f"seed {rec['seed']} {rec['optim']:<16} {rec['steps']} steps: held-out {rec['heldout_loss']:.4f}, "
                    f"recall train {rec['recall_train']:.3f} / held-out {rec['recall_heldout']:.3f} "
                    f"({rec['train_time_s']:.0f} s)",
                    file=log,
                    flush=True,
                )
    summary = {
        "budget": args.budget,
        **summarize(records, args.optims, args.seeds),
        "runs": [records[k] for k in sorted(records, key=lambda k: (k[1], k[0]))],
    }
    if keep:
        (keep / "summary.json").write_text(json.dumps(summary, indent=1))
    if args.json:
        print(json.dumps(summary))
        return
    for name, stats in summary["per_optim"].items():
        print(
            f"{name:<16} held-out {_ci(stats['heldout_loss'])}  recall train {_ci(stats['recall_train'], 3)} "
            f"held-out {_ci(stats['recall_heldout'], 3)}"
        )
    for pair, stats in summary["paired"].items():
        per = " / ".join(f"{v:+.4f}" for v in stats["heldout_loss"]["per_seed"].values())
        print(
            f"{pair}: held-out {_ci(stats['heldout_loss'])} [{per}]  recall train "
            f"{_ci(stats['recall_train'], 3)} held-out {_ci(stats['recall_heldout'], 3)} (paired by seed)"
        )
    means = " ".join(
        f"{n}_mean={s['heldout_loss']['mean']:.4f}" for n, s in summary["per_optim"].items() if s["heldout_loss"]["n"]
    )
    diffs = " ".join(
        f"{p.replace('-', '_minus_')}={s['heldout_loss']['mean']:+.4f}"
        for p, s in summary["paired"].items()
        if s["heldout_loss"]["n"]
    )
    print(f"RESULT budget={args.budget} best={summary['best']} {means} {diffs}")


if __name__ == "__main__":
    main()
