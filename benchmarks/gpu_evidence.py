"""Dense, dense_embed and STEM under `--recipe official` at matched training FLOPs, 2 seeds: held-out losses and
their paired differences (is STEM's gain more than a per-token table at a higher lr?).

    bash benchmarks/gpu_evidence.sh                      # one CUDA GPU, the embedded corpus, at most 8 minutes
    bash benchmarks/gpu_evidence.sh runs/shards          # a folder from `stemlm data prepare` instead
    python benchmarks/gpu_evidence.py --plan             # the plan (shape, steps, planned time) without training
    python benchmarks/gpu_evidence.py --cpu-smoke        # the same code at a toy shape on the CPU

The three variants share one backbone and differ only where named: `dense` (SwiGLU everywhere), `dense_embed`
(dense, its token embedding at the STEM tables' lr and weight decay: `stemlm.experiments.compare.VARIANTS`, i.e.
`TrainConfig.embed_like_tables`) and `stem` (the up-projection of the STEM layers replaced by token tables). Each
trains through `stemlm.train.Trainer` under `recipes.train_config({"recipe": "official", ...})` (truncated-normal
init, norm gains decayed, dense AdamW on the tables, a clip per optimizer, lingua's warm-up), in bf16 autocast,
for the steps that spend the same training FLOPs (`Trainer.flops_per_token`, i.e. `stemlm info`'s accounting:
3 x forward); held-out loss is the trainer's `evaluate()` at the end. Seeds pair the runs: a seed sets the init
and the data windows, so dense and STEM see the same windows in the same order (STEM, cheaper per token, sees
more of them).

GPU plan. Shape: the `paper-350m` preset (the official 350M config: d 960, 32 layers, 15/5 heads, STEM layers
2, 4, ..., 26) with the tokenizer's vocabulary (8192 for the embedded corpus) and the embedding untied from the
head, so that `dense_embed` moves the embedding, not the output layer too. 16 x 1024 tokens per step, lr 1e-3
(warm-up 10% of the steps, cosine to 0.1), tables and the dense_embed embedding at lr x10 and weight decay 0
(stemlm's measured table multiplier; `--table-lr-scale` changes it), backbone weight decay 0.1, clip 1.0.
Throughput ASSUMPTION: 100 TFLOP/s of model FLOPs (bf16 autocast, eager, no compile) on one H200, i.e. about
10% of its dense bf16 peak, chosen low so that the run fits even when the GPU does worse than expected; plus
45 s of start-up and 30 s per run (build, the official init drawn on the CPU, data, evaluation). The budget
(480 s by default) minus those overheads, at that throughput, split evenly over the 6 runs, gives each run's
training FLOPs; each variant then gets floor(FLOPs / (FLOPs per token x tokens per step)) steps. With the
embedded corpus (2.3M training tokens) that is about one epoch per run, so held-out loss measures more than
memorisation of repeated text. A plan below 20 dense steps, a vocabulary above 32768 (the per-run allowance
covers the tables' CPU init up to that) and data without a held-out split are refused (one line, exit 2).
While running, a seed whose three runs (timed on the first seed) would end past the budget is not started.

`--cpu-smoke`: d 64, 2 layers, 4 x 64 tokens per step, fp32 on the CPU, ASSUMED 2 GFLOP/s, a 60 s budget (20 s
start-up: tokenizing the embedded corpus; 2 s per run), at least 4 steps: it checks the path, its numbers are not
evidence.

Printed: the plan, one line per run, the paired differences with their Student-t 95% interval, then
`RESULT seed=<s> dense=<loss> dense_embed=<loss> stem=<loss> stem_minus_dense=<d> stem_minus_dense_embed=<d>`
per seed and `RESULT seeds=<n> dense=<mean> ... stem_minus_dense_embed=<mean> measured_tflops=<x>` (held-out
cross-entropy in nats, lower is better; a negative difference favours STEM). docs/recipe.md explains them.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import tempfile
import time
from typing import Any

from stemlm.experiments.compare import VARIANTS

# variant -> (FFN kind, TrainConfig changes): dense_embed is compare's own declaration of the control
SPECS: dict[str, tuple[str, dict]] = {
    "dense": ("dense", {}),
    "dense_embed": VARIANTS["dense_embed"],
    "stem": ("stem", {}),
}


@dataclasses.dataclass(frozen=True)
class Mode:
    """Everything the GPU run and the CPU smoke differ in (the module docstring states each value)."""

    device: str
    dtype: str
    assumed_tflops: float  # model FLOPs per second assumed, in TFLOP/s
    budget_s: float
    startup_s: float
    per_run_s: float
    min_steps: int
    max_vocab: int  # per_run_s covers the tables' CPU init up to this vocabulary
    seq_len: int
    batch_size: int
    shape: dict[str, Any]  # ModelConfig changes on the paper-350m preset


GPU = Mode(
    device="cuda",
    dtype="bf16",
    assumed_tflops=100.0,
    budget_s=480.0,
    startup_s=45.0,
    per_run_s=30.0,
    min_steps=20,
    max_vocab=32768,
    seq_len=1024,
    batch_size=16,
    shape={"tie_word_embeddings": False},
)
CPU_SMOKE = Mode(
    device="cpu",
    dtype="fp32",
    assumed_tflops=0.002,
    budget_s=60.0,
    startup_s=20.0,
    per_run_s=2.0,
    min_steps=4,
    max_vocab=32768,
    seq_len=64,
    batch_size=4,
    shape=dict(
        tie_word_embeddings=False,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=None,
        ffn_layers="odd",
    ),
)


def refuse(message: str) -> None:
    print(f"gpu_evidence: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "data", nargs="?", default=None, help="a prepared shard folder, or text files (default: the embedded corpus)"
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer for text --data (default: the folder's or stemlm's)")
    p.add_argument("--cpu-smoke", action="store_true", help="the toy CPU plan: checks the path, is no evidence")
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds (default 0,1)")
    p.add_argument("--budget-s", type=float, default=None, help="seconds for the whole run (default 480; smoke 60)")
    p.add_argument("--assume-tflops", type=float, default=None, help="assumed model TFLOP/s (default 100; smoke 0.002)")
    p.add_argument("--lr", type=float, default=1e-3, help="backbone peak lr (default 1e-3)")
    p.add_argument(
        "--table-lr-scale", type=float, default=10.0, help="tables' (and dense_embed's) lr / lr (default 10)"
    )
    p.add_argument("--plan", action="store_true", help="print the plan and exit (no training, no GPU needed)")
    args = p.parse_args(argv)
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if not args.seeds or len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        p.error("--seeds must be distinct non-negative integers")
    mode = CPU_SMOKE if args.cpu_smoke else GPU
    changes = {k: v for k, v in (("budget_s", args.budget_s), ("assumed_tflops", args.assume_tflops)) if v is not None}
    if any(v <= 0 for v in changes.values()) or args.lr <= 0 or args.table_lr_scale <= 0:
        p.error("--budget-s, --assume-tflops, --lr and --table-lr-scale must be positive")
    args.mode = dataclasses.replace(mode, **changes)
    return args


def train_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The TrainConfig changes every run shares (seed, steps, out and the variant's own come per run)."""
    mode = args.mode
    fields = dict(
        recipe="official",
        device=mode.device,
        dtype=mode.dtype,
        seq_len=mode.seq_len,
        batch_size=mode.batch_size,
        lr=args.lr,
        table_lr_scale=args.table_lr_scale,
        table_wd=0.0,
        fact_fraction=0.0,  # plain text: the question is language modelling, not the fact world
        eval_every=0,
        eval_batches=8,
        save_minutes=0.0,
    )
    if args.data:
        fields["data"] = [args.data]
    if args.tokenizer:
        fields["tokenizer"] = args.tokenizer
    return fields


def make_plan(mode: Mode, vocab_size: int, seeds: list[int]) -> dict[str, Any]:
    """Model configs, matched steps and the planned seconds of the run; refuses a budget that cannot fit."""
    from stemlm.model.accounting import training_flops_per_token
    from stemlm.model.presets import get_preset

    if vocab_size > mode.max_vocab:
        refuse(
            f"the tokenizer has {vocab_size} tokens; the plan's {mode.per_run_s:g} s per run covers the tables' init "
            f"up to {mode.max_vocab}: use a smaller vocabulary"
        )
    base = get_preset("paper-350m").replace(vocab_size=vocab_size, **mode.shape)
    configs = {name: base.replace(ffn=ffn) for name, (ffn, _) in SPECS.items()}
    tokens_per_step = mode.seq_len * mode.batch_size
    per_step = {name: training_flops_per_token(c, mode.seq_len) * tokens_per_step for name, c in configs.items()}
    runs = len(SPECS) * len(seeds)
    rate = mode.assumed_tflops * 1e12
    overhead = mode.startup_s + runs * mode.per_run_s
    flops = (mode.budget_s - overhead) * rate / runs  # each run's training FLOPs
    steps = {name: int(flops // f) if flops > 0 else 0 for name, f in per_step.items()}
    if min(steps.values()) < mode.min_steps:
        need = overhead + len(seeds) * sum(mode.min_steps * f for f in per_step.values()) / rate
        refuse(
            f"a {mode.budget_s:g} s budget cannot fit {runs} runs of {mode.min_steps}+ steps at an assumed "
            f"{mode.assumed_tflops:g} TFLOP/s (needs {need:.0f} s with {mode.startup_s:g} s start-up and "
            f"{mode.per_run_s:g} s per run)"
        )
    planned = overhead + len(seeds) * sum(steps[n] * per_step[n] for n in SPECS) / rate
    return {
        "configs": configs,
        "steps": steps,
        "flops": {n: steps[n] * per_step[n] for n in SPECS},
        "tokens": {n: steps[n] * tokens_per_step for n in SPECS},
        "planned_s": planned,
    }


def train_one(args: argparse.Namespace, plan: dict, tokenizer: Any, name: str, seed: int, tmp: str) -> dict:
    """One run through the trainer's own step and evaluation (no checkpoint: only the numbers are kept)."""
    import torch

    from stemlm.train.recipes import train_config
    from stemlm.train.trainer import Trainer

    start = time.perf_counter()
    changes = {**train_fields(args), **SPECS[name][1], "seed": seed, "steps": plan["steps"][name]}
    cfg = train_config({**changes, "out": f"{tmp}/{name}-seed{seed}"})
    trainer = Trainer(plan["configs"][name], cfg, tokenizer=tokenizer, progress=False)
    if trainer.heldout_data is None:
        refuse(f"{args.data or 'the corpus'} has no held-out split of one {cfg.seq_len}-token window to evaluate on")
    train_tokens = trainer.train_data.num_tokens
    for _ in range(cfg.steps):
        last = trainer.train_step()
    heldout = trainer.evaluate()
    trainer.batches.close()
    record = {
        "variant": name,
        "seed": seed,
        "steps": trainer.step,
        "epochs": plan["tokens"][name] / train_tokens,
        "heldout_loss": heldout,
        "train_loss": last["loss"],
        "skipped_steps": trainer.skipped_steps,
        "train_s": trainer.train_time,
        "wall_s": time.perf_counter() - start,
    }
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return record


def summarize(records: dict[tuple[str, int], dict], seeds: list[int]) -> dict[str, Any]:
    """Per seed with all three runs: the losses and the paired differences; their mean_ci95 over those seeds."""
    from stemlm.experiments.stats import mean_ci95

    rows = []
    for seed in seeds:
        if all((n, seed) in records for n in SPECS):
            loss = {n: records[(n, seed)]["heldout_loss"] for n in SPECS}
            rows.append(
                {"seed": seed, **loss, **{f"stem_minus_{b}": loss["stem"] - loss[b] for b in SPECS if b != "stem"}}
            )
    keys = [k for k in (rows[0] if rows else {}) if k != "seed"]
    return {"per_seed": rows, "mean": {k: mean_ci95(r[k] for r in rows) for k in keys}}


def main(argv: list[str] | None = None) -> None:
    started = time.monotonic()
    args = parse_args(argv)
    from stemlm.train.config import TrainConfig
    from stemlm.train.data import resolve_tokenizer

    mode = args.mode
    tokenizer = resolve_tokenizer(
        TrainConfig(**{k: v for k, v in train_fields(args).items() if k in ("data", "tokenizer")})
    )
    plan = make_plan(mode, tokenizer.get_vocab_size(), args.seeds)
    shape = plan["configs"]["stem"]
    print(
        f"plan: d {shape.hidden_size}, {shape.num_hidden_layers} layers, vocab {shape.vocab_size}, STEM layers "
        f"{shape.special_layers}; {mode.batch_size} x {mode.seq_len} tokens per step on {mode.device} ({mode.dtype}); "
        f"seeds {args.seeds}; assumed {mode.assumed_tflops:g} TFLOP/s: planned {plan['planned_s']:.0f} s of "
        f"{mode.budget_s:g} s"
    )
    for n in SPECS:
        print(f"plan: {n:<11} {plan['steps'][n]} steps, {plan['tokens'][n]:,} tokens, {plan['flops'][n]:.3e} FLOPs")
    if args.plan:
        return
    if mode.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            refuse("no CUDA device here; --cpu-smoke runs the path on the CPU, --plan prints the plan")
    records: dict[tuple[str, int], dict] = {}
    seed_wall = 0.0
    with tempfile.TemporaryDirectory(prefix="gpu-evidence-") as tmp:
        for i, seed in enumerate(args.seeds):
            elapsed = time.monotonic() - started
            if i and elapsed + seed_wall > mode.budget_s:  # the first seed's three runs timed this one
                print(f"budget: seed {seed} not started ({elapsed:.0f} s + {seed_wall:.0f} s > {mode.budget_s:g} s)")
                break
            for name in SPECS:
                rec = train_one(args, plan, tokenizer, name, seed, tmp)
                records[(name, seed)] = rec
                seed_wall = seed_wall if i else seed_wall + rec["wall_s"]
                tflops = plan["flops"][name] / rec["train_s"] / 1e12
                print(
                    f"seed {seed} {name:<11} {rec['steps']} steps ({rec['epochs']:.3g} epochs): held-out "
                    f"{rec['heldout_loss']:.4f}, train {rec['train_loss']:.4f}, skipped {rec['skipped_steps']} "
                    f"({rec['train_s']:.0f} s training at {tflops:.3g} TFLOP/s, {rec['wall_s']:.0f} s in all)",
                    flush=True,
                )
    report(summarize(records, args.seeds), records, plan, time.monotonic() - started)


def report(summary: dict, records: dict, plan: dict, wall: float) -> None:
    from stemlm.experiments.stats import format_ci

    for key, entry in summary["mean"].items():
        if key.startswith("stem_minus_"):
            print(f"{key}: {format_ci(entry, 4)} (n={entry['n']}, paired by seed)")
    for row in summary["per_seed"]:
        print("RESULT " + " ".join(f"{k}={v}" if k == "seed" else f"{k}={v:.4f}" for k, v in row.items()))
    flops = sum(plan["flops"][name] for name, _ in records)
    measured = flops / sum(r["train_s"] for r in records.values()) / 1e12 if records else 0.0
    means = " ".join(f"{k}={e['mean']:.4f}" for k, e in summary["mean"].items())
    print(f"RESULT seeds={len(summary['per_seed'])} {means} measured_tflops={measured:.3g} wall_s={wall:.0f}")


if __name__ == "__main__":
    main()
