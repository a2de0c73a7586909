"""`stemlm experiment <name>`: reproducible experiments, one registration function per entry of `EXPERIMENTS`.

    stemlm experiment knowledge --out runs/knowledge            # dense vs STEM fact recall + knowledge editing

To add `stemlm experiment compare` (or another), write a function `register_<name>(subparsers)` adding ONE
parser to the given group (help on every flag, `set_defaults(func=...)`) and append "module:function" here.
"""

from __future__ import annotations

import sys

from stemlm.cli.common import add_json_flag, print_json
from stemlm.cli.eval import register_group
from stemlm.errors import StemlmError

EXPERIMENTS = [
    "stemlm.cli.experiment:register_knowledge",
    "stemlm.cli.experiment_compare:register_experiment",
    "stemlm.cli.experiment_bio:register_experiment",
]


def run_knowledge(args) -> int:
    import dataclasses

    from stemlm.experiments.knowledge import KnowledgeConfig, run_knowledge

    fields = {f.name: f for f in dataclasses.fields(KnowledgeConfig)}
    overrides = {}
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep or key not in fields or key == "extra":
            raise StemlmError(f"--set {item!r}: expected key=value with key one of {', '.join(sorted(fields))}")
        default = getattr(KnowledgeConfig, key, None)
        overrides[key] = _parse(value, default, key)
    cfg = KnowledgeConfig(
        out=args.out,
        dense_steps=args.steps,
        edit_records=args.records,
        diagnostics=not args.no_diagnostics,
        parallel=not args.serial,
        **overrides,
    )
    if cfg.dense_steps < 1:
        raise StemlmError(f"--steps must be positive, got {cfg.dense_steps}")
    results = run_knowledge(cfg, log=lambda m: print(m, file=sys.stderr))
    if args.json:
        print_json(results)
    else:
        print((__import__("pathlib").Path(cfg.out) / "results.md").read_text())
    return 0


def _parse(value: str, default, key: str):
    if isinstance(default, bool):
        if value.lower() not in ("true", "false", "1", "0"):
            raise StemlmError(f"--set {key}: expected true or false, got {value!r}")
        return value.lower() in ("true", "1")
    if isinstance(default, tuple):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    try:
        return type(default)(value) if default is not None else value
    except ValueError:
        raise StemlmError(f"--set {key}: {value!r} is not a valid {type(default).__name__}") from None


def register_knowledge(subparsers) -> None:
    from stemlm.experiments.knowledge import KnowledgeConfig

    d = KnowledgeConfig()
    p = subparsers.add_parser(
        "knowledge",
        help="dense vs STEM at matched FLOPs: fact recall and edit metrics",
        description="Train dense and STEM models on the fact world mixed with the embedded "
        "corpus at matched training FLOPs, then measure fact recall and edits.",
    )
    p.add_argument("--out", default=d.out, help=f"output folder for runs, results.json, results.md (default {d.out})")
    p.add_argument(
        "--steps",
        type=int,
        default=d.dense_steps,
        help=f"dense training steps; STEM gets the FLOP-matched count (default {d.dense_steps})",
    )
    p.add_argument("--records", type=int, default=d.edit_records, help=f"edit records (default {d.edit_records})")
    p.add_argument("--no-diagnostics", action="store_true", help="skip the per-layer / strategy diagnostics")
    p.add_argument("--serial", action="store_true", help="train the two models one after the other")
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override any KnowledgeConfig field, e.g. --set fact_repeats=40 (repeatable)",
    )
    add_json_flag(p)
    p.set_defaults(func=run_knowledge)


def register(subparsers) -> None:
    register_group(
        subparsers,
        "experiment",
        EXPERIMENTS,
        help_text="run a reproducible experiment (knowledge, ...)",
        description="Experiments that train, evaluate and write results.json + results.md.",
    )
