"""`stemlm experiment bio`: the synthetic-biography world, memorisation vs extraction for dense and STEM.

    stemlm experiment bio --out runs/bio                       # default budget, 2 seeds
    stemlm experiment bio --quick --seeds 2 --json --out runs/bio-quick
    stemlm experiment bio --set people=400 --set dense_steps=1200 --out runs/bio-big

Writes OUT/results.json and OUT/results.md (see `stemlm.experiments.bio` for the protocol); `--json` prints
the same object: `per_seed` (one entry per seed) and `summary` (metric -> mean and ci95).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from stemlm.cli.common import add_json_flag, print_json
from stemlm.errors import StemlmError


def _overrides(items: list[str] | None) -> dict:
    from stemlm.experiments.bio import BioConfig

    defaults = BioConfig()
    fields = {f.name for f in dataclasses.fields(BioConfig)} - {"out"}
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise StemlmError(f"--set {item!r}: expected key=value with key one of {', '.join(sorted(fields))}")
        default = getattr(defaults, key)
        try:
            if isinstance(default, bool):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                out[key] = value.lower() in ("true", "1")
            else:
                out[key] = type(default)(value)
        except ValueError:
            raise StemlmError(f"--set {key}: {value!r} is not a valid {type(default).__name__}") from None
    return out


def run(args) -> int:
    from stemlm.experiments.bio import BioConfig, quick, run_bio

    cfg = BioConfig(out=args.out, parallel=not args.serial)
    cfg = quick(cfg) if args.quick else cfg
    cfg = dataclasses.replace(cfg, **_overrides(args.set))
    if cfg.people < 4 or cfg.dense_steps < 1 or cfg.bios_per_person < 1:
        raise StemlmError("people must be >= 4, dense_steps and bios_per_person >= 1")
    results = run_bio(cfg, seeds=args.seeds, log=lambda m: print(m, file=sys.stderr))
    if args.json:
        print_json(results)
    else:
        print(Path(cfg.out, "results.md").read_text())
    return 0


def register_experiment(subparsers) -> None:
    p = subparsers.add_parser(
        "bio",
        help="synthetic biographies: memorisation vs extraction on held-out people, dense vs STEM",
        description="Train dense and STEM models at matched FLOPs on synthetic biographies (QA for half the "
        "people), then measure memorisation, QA extraction on the held-out half against chance, and knowledge "
        "bits per parameter, over several seeds.",
    )
    p.add_argument(
        "--out",
        default="runs/bio",
        help="output folder (default runs/bio); seeds already there with the same settings are reused",
    )
    p.add_argument("--seeds", type=int, default=2, help="seeds 0..N-1 (default 2)")
    p.add_argument("--quick", action="store_true", help="reduced budget (60 people, 80 dense steps): a smoke run")
    p.add_argument("--serial", action="store_true", help="train the two models one after the other")
    p.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a BioConfig field, e.g. --set people=400"
    )
    add_json_flag(p)
    p.set_defaults(func=run)
