"""Knowledge capacity in bits per parameter (Physics of Language Models part 3.3) for dense and STEM at two sizes.

Each model trains on biographies only (no QA) of `--people` synthetic people (`stemlm.data.worlds.bio`) at a matched
training-FLOP budget per size (dense `--steps` steps; STEM the FLOP-matched count). Knowledge bits: per
attribute max(0, N·log2 K − the model's summed loss in bits on the values after the first biography
template), summed over the five attributes (`stemlm.experiments.bio.knowledge_bits`); divided by total
parameters and by active parameters (STEM tables excluded). The part 3.3 figure (about 2 bits/param) is a
saturation value after ~1000 exposures per fact; this benchmark's default budget gives tens of exposures, so
its figures are lower bounds at an unsaturated budget, not capacities.

Run: `python benchmarks/bio_capacity.py --out runs/bio-capacity [--people 100 --steps 300 --seed 0]`
(two models at a time, one thread each; ~15-30 min on two shared CPU cores; `--sizes small` for one size)
Last line: `RESULT dense_small_bits_per_param=... stem_small_bits_per_param=... dense_base_... stem_base_...`
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from stemlm.experiments.bio import BioConfig, build_data, knowledge_bits, matched_steps, model_configs, train_models
from stemlm.experiments.contract import ExperimentLog
from stemlm.model.accounting import active_parameters, total_parameters

SIZES = {"small": dict(hidden_size=64, intermediate_size=192), "base": dict(hidden_size=128, intermediate_size=384)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bio-capacity", help="output folder (must not exist)")
    parser.add_argument("--people", type=int, default=100, help="synthetic people (default 100)")
    parser.add_argument("--bios", type=int, default=4, help="biographies per person (default 4)")
    parser.add_argument("--steps", type=int, default=300, help="dense training steps per size (default 300)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the people and the models (default 0)")
    parser.add_argument(
        "--sizes", default=",".join(SIZES), help=f"comma-separated sizes from {', '.join(SIZES)} (default all)"
    )
    args = parser.parse_args(argv)
    sizes = args.sizes.split(",")
    if not sizes or set(sizes) - set(SIZES):
        parser.error(f"--sizes must name sizes from {', '.join(SIZES)}, got {args.sizes!r}")
    from stemlm.checkpoint.runs import load_checkpoint

    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"{out} exists; choose another --out")
    rows = {}
    for size in sizes:
        dims = SIZES[size]
        cfg = replace(
            BioConfig(out=str(out)),
            people=args.people,
            bios_per_person=args.bios,
            qa_repeats=0,
            dense_steps=args.steps,
            num_hidden_layers=2,
            seq_len=64,
            **dims,
        )
        people, tokenizer, data = build_data(cfg, args.seed, out / size / "data")
        configs = model_configs(cfg)
        steps = matched_steps(configs, cfg.seq_len, cfg.dense_steps)
        fits = train_models(cfg, args.seed, configs, steps, tokenizer, data, out / size / "runs", ExperimentLog())
        for kind, config in configs.items():
            model = load_checkpoint(fits[kind]["checkpoint"])[0]
            bits = knowledge_bits(model, tokenizer, people)
            exposures = steps[kind] * cfg.seq_len * cfg.batch_size / len(tokenizer.encode(data.read_text()).ids)
            rows[f"{kind}_{size}"] = {
                "steps": steps[kind],
                "params_total": total_parameters(config),
                "params_active": active_parameters(config)["backbone"],
                "bits": bits,
                "bits_per_param": bits["total"] / total_parameters(config),
                "bits_per_active_param": bits["total"] / active_parameters(config)["backbone"],
                "exposures_per_fact": exposures * cfg.bios_per_person,
            }
            print(f"{kind} {size}: {json.dumps(rows[f'{kind}_{size}'])}", flush=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    print("RESULT " + " ".join(f"{k}_bits_per_param={v['bits_per_param']:.4f}" for k, v in rows.items()))


if __name__ == "__main__":
    main()
