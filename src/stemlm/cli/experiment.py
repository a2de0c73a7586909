"""`stemlm experiment <name>`: reproducible experiments, one subcommand built from each module of `EXPERIMENTS`.

    stemlm experiment knowledge --out runs/knowledge            # dense vs STEM fact recall + edits, 3 seeds
    stemlm experiment knowledge --quick --seeds 2 --json        # reduced budget
    stemlm experiment compare --kinds dense,stem --budget 2e12 --match flops --json
    stemlm experiment bio --set people=400 --set dense_steps=1200 --out runs/bio-big

Each module exposes `EXPERIMENT` (stemlm.experiments.contract): its options dataclass gives the flags (each
field's `stemlm.flags.setting`), `--quick`, `--set KEY=VALUE`, `--no-progress` and `--json` come with the contract.
To add an experiment, write its module and append its name here.
"""

from __future__ import annotations

import functools
import importlib
import sys

from stemlm.cli.common import add_field_flags, add_json_flag, print_json, register_group
from stemlm.flags import given_fields

EXPERIMENTS = ["stemlm.experiments.knowledge", "stemlm.experiments.compare", "stemlm.experiments.bio"]


def add_experiment(subparsers, module: str) -> None:
    """Add `stemlm experiment <name>` for the module's `EXPERIMENT`."""
    from stemlm.experiments.contract import flag_help

    experiment = importlib.import_module(module).EXPERIMENT
    p = subparsers.add_parser(experiment.name, help=experiment.help, description=experiment.description)
    add_field_flags(p, experiment.options, describe=functools.partial(flag_help, experiment))
    if experiment.quick:
        values = ", ".join(f"{k}={v}" for k, v in experiment.quick.items())
        text = f"reduced budget for CI and first tries: {values} (given flags and --set still apply on top)"
        p.add_argument("--quick", action="store_true", help=text)
    if experiment.settable:
        text = f"override any {experiment.options.__name__} field by name (repeatable)"
        p.add_argument("--set", dest="set_fields", action="append", default=[], metavar="KEY=VALUE", help=text)
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr (seeds, runs)")
    add_json_flag(p)
    p.set_defaults(func=functools.partial(run, experiment))


def run(experiment, args) -> int:
    from stemlm.experiments.contract import ExperimentLog, resolve_options

    given = given_fields(args, experiment.options)
    sets = getattr(args, "set_fields", [])
    options = resolve_options(experiment, given, getattr(args, "quick", False), sets)
    results = experiment.run(options, ExperimentLog(progress=not args.no_progress))
    if args.json:
        print_json(experiment.json(options, results))
        return 0
    print(experiment.text(options, results))
    if experiment.done is not None:
        print(experiment.done(options, results), file=sys.stderr)
    return 0


def register(subparsers) -> None:
    register_group(
        subparsers,
        "experiment",
        [functools.partial(add_experiment, module=m) for m in EXPERIMENTS],
        help_text="run a reproducible experiment (knowledge, ...)",
        description="Experiments that train, evaluate and write results.json + results.md.",
    )
