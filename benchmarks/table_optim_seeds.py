"""Held-out loss of the table optimizers over several seeds at one training budget (decides the default).

Each (optimizer, seed) pair trains the `tiny` STEM preset with `stemlm.train.Trainer` at the given budget
(default: the main job, `stemlm train` with no flags: 150 steps of 8 x 256 tokens; the seed sets both the
initialisation and the data windows) and records the final held-out loss; the pairs run interleaved by seed
so machine load hits the optimizers alike. Printed: every run, then per optimizer the mean, the sample
standard deviation and the mean paired difference against the first optimizer with its standard error.

    OMP_NUM_THREADS=1 python benchmarks/table_optim_seeds.py                       # ~6 x 5 CPU-minutes
    python benchmarks/table_optim_seeds.py --optims lazy_adamw,rowwise_adagrad,adamw --seeds 0,1,2 --steps 40

Last line: `RESULT best=<optimizer> <name>_mean=... ...` (lower held-out loss is better).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from stemlm.train import TrainConfig, Trainer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--optims", default="lazy_adamw,rowwise_adagrad", help="comma-separated table optimizers")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps per run (default 150: the main job)")
    p.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    optims = args.optims.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    losses: dict[str, list[float]] = {name: [] for name in optims}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for name in optims:
                cfg = TrainConfig(
                    preset=args.preset,
                    steps=args.steps,
                    seed=seed,
                    table_optim=name,
                    out=f"{tmp}/{name}-{seed}",
                    eval_every=0,
                    device="cpu",
                )
                result = Trainer(None, cfg, progress=False).fit()
                losses[name].append(result["heldout_loss"])
                print(
                    f"seed {seed} {name:<16} held-out {result['heldout_loss']:.4f} "
                    f"({result['tokens_per_s']:,.0f} tok/s)",
                    flush=True,
                )
    base = optims[0]
    for name in optims:
        xs = losses[name]
        sd = statistics.stdev(xs) if len(xs) > 1 else float("nan")
        diffs = [a - b for a, b in zip(xs, losses[base], strict=True)]
        se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
        print(
            f"{name:<16} mean {statistics.mean(xs):.4f} sd {sd:.4f}  minus {base}: "
            f"{statistics.mean(diffs):+.4f} ± {se:.4f} (se, paired by seed)"
        )
    best = min(optims, key=lambda n: statistics.mean(losses[n]))
    means = " ".join(f"{n}_mean={statistics.mean(losses[n]):.4f}" for n in optims)
    print(f"RESULT best={best} {means}")


if __name__ == "__main__":
    main()
