"""`stemlm experiment compare`: dense / STEM / MoE / hash-MoE / PLE trained at a matched budget, evaluated alike.

    stemlm experiment compare --kinds dense,stem,moe,hash_moe,ple --budget 300 --out runs/compare
    stemlm experiment compare --kinds dense,stem --budget 2e12 --match flops --json
    stemlm experiment compare --quick --seeds 2 --kinds dense,stem --json    # reduced budget, 2 seeds

Writes OUT/results.json, OUT/report.md and PNG plots (see `stemlm.experiments.compare` for the protocol);
rerunning with the same settings reuses every kind already finished. This module adds the `compare`
subcommand to the `stemlm experiment` group.
"""

from __future__ import annotations

import sys
from pathlib import Path

from stemlm.cli.common import add_json_flag, print_json


def register_experiment(subparsers) -> None:
    from stemlm.experiments.compare import add_arguments

    parser = subparsers.add_parser(
        "compare",
        help="dense vs STEM vs MoE vs hash-MoE vs PLE over seeds, at matched FLOPs and matched tokens",
        description="Train each FFN kind on the same data, tokenizer and seed at a matched training budget, "
        "evaluate each (held-out loss, lm-eval tasks, needle in a haystack) and write a report folder.",
    )
    add_arguments(parser)
    add_json_flag(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    from stemlm.experiments.compare import config_from_args, run_compare

    cfg = config_from_args(args)
    report = run_compare(cfg)
    if args.json:
        print_json({"out": cfg.out, **report})
        return 0
    print(Path(cfg.out, "report.md").read_text())
    print(f"report folder: {cfg.out} ({report['wall_s']:.0f} s)", file=sys.stderr)
    return 0
