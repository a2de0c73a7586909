"""`stemlm experiment <name>`: reproducible experiments, one registration function per entry of `EXPERIMENTS`.

    stemlm experiment knowledge --out runs/knowledge            # dense vs STEM fact recall + edits, 3 seeds
    stemlm experiment knowledge --quick --seeds 2 --json        # reduced budget

To add `stemlm experiment compare` (or another), write a function `register_<name>(subparsers)` adding ONE
parser to the given group (help on every flag, `set_defaults(func=...)`) and append "module:function" here.
"""

from __future__ import annotations

import sys

from stemlm.cli.common import add_json_flag, print_json, register_group
from stemlm.errors import StemlmError

EXPERIMENTS = [
    "stemlm.cli.experiment:register_knowledge",
    "stemlm.cli.experiment_compare:register_experiment",
    "stemlm.cli.experiment_bio:register_experiment",
]


def run_knowledge(args) -> int:
    import dataclasses

    from stemlm.experiments.knowledge import QUICK, KnowledgeConfig, run_knowledge

    fields = {f.name: f for f in dataclasses.fields(KnowledgeConfig)}
    values = dict(QUICK) if args.quick else {}
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep or key not in fields or key == "extra":
            raise StemlmError(f"--set {item!r}: expected key=value with key one of {', '.join(sorted(fields))}")
        values[key] = _parse(value, getattr(KnowledgeConfig, key, None), key)
    flags = {
        "out": args.out,
        "seeds": args.seeds,
        "dense_steps": args.steps,
        "edit_records": args.records,
        "lr_sweep": args.lr_sweep,
        "preset": args.preset,
        "device": args.device,
        "batch_size": args.batch_size,
    }
    values.update({k: v for k, v in flags.items() if v is not None})
    if args.no_diagnostics:
        values["diagnostics"] = False
    if args.serial:
        values["parallel"] = False
    if args.preset:
        from stemlm.model.presets import get_preset

        get_preset(args.preset)  # an unknown name fails here, before any data is written
    results = run_knowledge(KnowledgeConfig(**values), log=lambda m: print(m, file=sys.stderr))
    if args.json:
        print_json(
            {
                k: results[k]
                for k in ("config", "interval", "recall_chance", "lrs", "sweep", "per_seed", "summary", "wall_s")
            }
        )
    else:
        print((__import__("pathlib").Path(values["out"]) / "results.md").read_text())
    return 0


def _parse(value: str, default, key: str):
    if isinstance(default, bool):
        if value.lower() not in ("true", "false", "1", "0"):
            raise StemlmError(f"--set {key}: expected true or false, got {value!r}")
        return value.lower() in ("true", "1")
    if isinstance(default, tuple):
        items = tuple(v.strip() for v in value.split(",") if v.strip())
        return tuple(float(v) for v in items) if key == "lr_sweep" else items
    try:
        return type(default)(value) if default is not None else value
    except ValueError:
        raise StemlmError(f"--set {key}: {value!r} is not a valid {type(default).__name__}") from None


def _floats(text: str) -> tuple[float, ...]:
    import argparse

    if text.strip().lower() == "none":
        return ()
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers (or 'none')") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: learning rates must be positive")
    return values


def register_knowledge(subparsers) -> None:
    from stemlm.experiments.knowledge import QUICK, KnowledgeConfig

    d = KnowledgeConfig()
    p = subparsers.add_parser(
        "knowledge",
        help="dense vs STEM at matched FLOPs: fact recall and edit metrics",
        description="Train dense and STEM models on the fact world mixed with the embedded "
        "corpus at matched training FLOPs, then measure fact recall and edits.",
    )
    p.add_argument("--out", default=d.out, help=f"output folder for runs, results.json, results.md (default {d.out})")
    p.add_argument(
        "--seeds", type=int, help=f"final seeds, seed..seed+N-1 (default {d.seeds}; --quick: {QUICK['seeds']})"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="reduced budget for CI and first tries: "
        + ", ".join(f"{k}={v}" for k, v in QUICK.items())
        + " (other flags and --set still apply on top)",
    )
    p.add_argument(
        "--steps",
        type=int,
        help=f"dense training steps (the reference budget); STEM gets the FLOP-matched count and a "
        f"token-matched run (default {d.dense_steps}; --quick: {QUICK['dense_steps']})",
    )
    p.add_argument(
        "--lr-sweep",
        type=_floats,
        metavar="LR1,LR2,..",
        help="lrs each lr family is tuned over on the sweep seed; 'none' skips the sweep "
        f"(default {','.join(map(str, d.lr_sweep))}; --quick: none)",
    )
    p.add_argument("--preset", help="take the model shape from this preset (stemlm info --presets) for scale-up runs")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), help=f"training device (default {d.device})")
    p.add_argument("--batch-size", type=int, help=f"sequences per step (default {d.batch_size})")
    p.add_argument("--records", type=int, help=f"edit records per seed (default {d.edit_records})")
    p.add_argument("--no-diagnostics", action="store_true", help="skip the per-layer / strategy diagnostics")
    p.add_argument("--serial", action="store_true", help="train the arms one after the other")
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
