"""The biography experiment: do dense and STEM models store facts they can extract for people never asked about?

    stemlm experiment bio --out runs/bio                     # default budget, 2 seeds
    stemlm experiment bio --quick --seeds 2 --json           # reduced budget (CI, first tries)

Per seed (the seed draws the people, the documents, the tokenizer's data and the initialisation):

1. Data (`stemlm.data.worlds.bio`): `people` synthetic people; `bios_per_person` biographies each (random
   templates, random sentence order); QA documents (`qa_repeats` each) for the first half of the people only.
   A slice of the
   embedded corpus closes the file, so the trainer's held-out tail (the last 10%) is natural text and every
   biography and QA line is trained on.
2. Training: dense and its STEM twin (STEM in the odd layers, tables at the trainer's default lr x10) at
   matched training FLOPs (the STEM run gets more steps; both step counts and token counts are reported).
3. Evaluation, exact greedy match of the full answer:
   - memorisation: biography sentence prefixes (every template) of both halves;
   - QA on the QA-trained half (in distribution);
   - extraction: QA on the held-out half (people whose QA was never trained: the skill that generalises),
     on trained phrasings and on a never-trained phrasing;
   - chance: the name-blind best constant answer (most frequent training value) on the held-out half;
   - knowledge bits (Physics of LMs part 3.3): sum over attributes of N·log2(K) minus the model's summed loss
     (bits) on the values after the first biography template, floored at 0 per attribute; per parameter
     (total and active).
Writes OUT/results.json and OUT/results.md; `per_seed` and `summary` (mean, ci95: t over seeds, see
`stemlm.experiments.stats`). Each seed's result is kept in OUT/seedN/result.json, so rerunning with more
`--seeds` and the same settings trains only the new seeds.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from tokenizers import Tokenizer

from stemlm.data import EOT_TOKEN, embedded_texts, train_bpe
from stemlm.data.worlds import bio
from stemlm.edit.evaluate import score_items
from stemlm.errors import StemlmError
from stemlm.experiments.contract import Experiment, ExperimentLog, results_file
from stemlm.experiments.folders import claim_out, start_unit
from stemlm.experiments.knowledge import train_all
from stemlm.experiments.stats import summarize_seeds
from stemlm.flags import setting
from stemlm.model.accounting import active_parameters, total_parameters, training_flops_per_token
from stemlm.model.config import ModelConfig


@dataclass
class BioConfig:
    out: str = setting(
        "runs/bio", "output folder; seeds already there with the same settings are reused", metavar="OUT"
    )
    people: int = 100
    bios_per_person: int = 6  # distinct biographies per person (the paper's multi-bio augmentation)
    qa_repeats: int = 2  # QA documents per QA-trained person
    corpus_chars: int = 20_000  # natural text after the world; the trainer's held-out tail comes from it
    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    stem_layers: str = "odd"
    seq_len: int = 128
    batch_size: int = 16
    dense_steps: int = 400  # the STEM run gets the steps that match this run's training FLOPs
    lr: float = 3e-3
    parallel: bool = setting(  # train the two models in two processes (one thread each)
        True, "train the two models one after the other", name="--serial", const=False
    )


# The reduced budget of `--quick`: fewer people and steps (for CI and first tries; near chance).
QUICK = dict(people=60, bios_per_person=3, dense_steps=80, corpus_chars=8_000)


@dataclass
class BioOptions(BioConfig):
    """The command's options: the config and the number of seeds (kept out of the config, which a seed's saved
    settings are compared against)."""

    seeds: int = setting(2, "seeds 0..N-1", metavar="N")


# ----------------------------------------------------------------------------------------------------------
# data and training
# ----------------------------------------------------------------------------------------------------------
def build_data(cfg: BioConfig, seed: int, folder: Path):
    """(people, tokenizer, data file): the world's documents, then natural text for the held-out tail."""
    people = bio.make_people(cfg.people, seed)
    qa_people, _ = bio.split_people(people)
    world = EOT_TOKEN.join(bio.world_documents(people, qa_people, cfg.bios_per_person, cfg.qa_repeats, seed))
    texts = embedded_texts("train")
    random.Random(seed).shuffle(texts)
    corpus = EOT_TOKEN.join(texts)[: max(cfg.corpus_chars, len(world) // 9 + 1)]  # >= the 10% held-out tail
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "train.txt"
    data.write_text(world + EOT_TOKEN + corpus, encoding="utf-8")
    return people, train_bpe([world, corpus], vocab_size=cfg.vocab_size), data


def model_configs(cfg: BioConfig) -> dict[str, ModelConfig]:
    base = ModelConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        max_position_embeddings=max(256, cfg.seq_len),
        ffn="stem",
        ffn_layers=cfg.stem_layers,
    )
    return {"dense": base.replace(ffn="dense"), "stem": base}


def matched_steps(configs: dict[str, ModelConfig], seq_len: int, dense_steps: int) -> dict[str, int]:
    dense = training_flops_per_token(configs["dense"], seq_len)
    return {n: round(dense_steps * dense / training_flops_per_token(c, seq_len)) for n, c in configs.items()}


def train_models(cfg: BioConfig, seed: int, configs, steps, tokenizer, data: Path, runs: Path, log) -> dict[str, dict]:
    jobs = []
    for name, config in configs.items():
        fields = dict(
            out=str(runs / name),
            data=[str(data)],
            seq_len=cfg.seq_len,
            batch_size=cfg.batch_size,
            steps=steps[name],
            lr=cfg.lr,
            seed=seed,
            eval_every=0,
            threads=1,
            device="cpu",
        )
        jobs.append((name, config.to_dict(), fields, tokenizer.to_str()))
    return train_all(jobs, len(jobs) if cfg.parallel else 1, log)


# ----------------------------------------------------------------------------------------------------------
# evaluation
# ----------------------------------------------------------------------------------------------------------
def _pairs(tokenizer: Tokenizer, prompts) -> list[tuple[list[int], list[int]]]:
    enc = lambda t: tokenizer.encode(t, add_special_tokens=False).ids  # noqa: E731
    return [(enc(p.prompt), enc(p.answer)) for p in prompts]


def exact_match(model, tokenizer: Tokenizer, prompts) -> dict:
    """Exact greedy match of the full answer: overall and per attribute (teacher-forced argmax = greedy)."""
    scores = score_items(model, _pairs(tokenizer, prompts), batch_rows=256)
    hits = [s[1] for s in scores]
    out = {"n": len(hits), "acc": sum(hits) / len(hits)}
    for a in bio.ATTRIBUTES:
        mine = [h for h, p in zip(hits, prompts, strict=True) if p.relation == a]
        out[a] = sum(mine) / len(mine) if mine else None
    return out


def knowledge_bits(model, tokenizer: Tokenizer, people: list[bio.Person]) -> dict:
    """Bits of knowledge stored about `people` (part 3.3): per attribute max(0, N·log2 K - loss in bits), with
    the loss summed over the value tokens after the first biography template."""
    prompts = bio.bio_prompts(people, templates_per_attribute=1)
    scores = score_items(model, _pairs(tokenizer, prompts), batch_rows=256)
    out: dict = {}
    for a in bio.ATTRIBUTES:
        loss_bits = -sum(s[0] for s, p in zip(scores, prompts, strict=True) if p.relation == a) / math.log(2)
        out[a] = max(0.0, len(people) * bio.attribute_bits(a) - loss_bits)
    out["total"] = sum(out[a] for a in bio.ATTRIBUTES)
    out["entropy"] = len(people) * sum(bio.attribute_bits(a) for a in bio.ATTRIBUTES)  # the most there is to learn
    return out


def evaluate(model, tokenizer: Tokenizer, people: list[bio.Person]) -> dict:
    qa_people, held = bio.split_people(people)
    bits = knowledge_bits(model, tokenizer, people)
    return {
        "memorisation": exact_match(model, tokenizer, bio.bio_prompts(people)),
        "memorisation_heldout_people": exact_match(model, tokenizer, bio.bio_prompts(held)),
        "qa_trained_people": exact_match(model, tokenizer, bio.qa_prompts(qa_people, "train")),
        "extraction": exact_match(model, tokenizer, bio.qa_prompts(held, "train")),
        "extraction_heldout_phrasing": exact_match(model, tokenizer, bio.qa_prompts(held, "heldout")),
        "knowledge_bits": bits,
        "bits_per_param": bits["total"] / total_parameters(model.config),
        "bits_per_active_param": bits["total"] / active_parameters(model.config)["backbone"],
    }


def run_seed(cfg: BioConfig, seed: int, folder: Path, log) -> dict:
    from stemlm.checkpoint.runs import load_checkpoint

    people, tokenizer, data = build_data(cfg, seed, folder / "data")
    qa_people, held = bio.split_people(people)
    configs = model_configs(cfg)
    steps = matched_steps(configs, cfg.seq_len, cfg.dense_steps)
    log(f"seed {seed}: training dense ({steps['dense']} steps) and STEM ({steps['stem']} steps) at matched FLOPs")
    fits = train_models(cfg, seed, configs, steps, tokenizer, data, folder / "runs", log)
    out: dict = {"seed": seed, "chance": bio.chance(qa_people, held)}
    for name, config in configs.items():
        model = load_checkpoint(fits[name]["checkpoint"])[0]
        tokens = steps[name] * cfg.seq_len * cfg.batch_size
        out[name] = {
            "steps": steps[name],
            "tokens": tokens,
            "train_flops": training_flops_per_token(config, cfg.seq_len) * tokens,
            "params_total": total_parameters(config),
            "params_active": active_parameters(config)["backbone"],
            "train_loss": fits[name]["train_loss"],
            "heldout_loss": fits[name]["heldout_loss"],
            **evaluate(model, tokenizer, people),
        }
    return out


def _seed_result(cfg: BioConfig, seed: int, folder: Path, log) -> dict:
    """A seed's result: reused from folder/result.json when it was written with the same settings, computed
    (and saved there) when the folder does not exist; any other folder is refused, never overwritten."""
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("out", "parallel")}
    saved = folder / "result.json"
    if saved.exists():
        record = json.loads(saved.read_text())
        if record["settings"] != settings:
            raise StemlmError(f"{folder} holds a seed run with other settings; choose another --out or delete it")
        log(f"seed {seed}: reusing {saved}")
        return record["result"]
    start_unit(folder, settings)  # refuses another command's seed; an interrupted one of ours starts over
    result = run_seed(cfg, seed, folder, log)
    saved.write_text(json.dumps({"settings": settings, "result": result}, indent=2) + "\n")
    return result


def run_bio(cfg: BioConfig, log: ExperimentLog, seeds: int = 2) -> dict:
    """Seeds 0..seeds-1 (each reused when OUT already holds it with the same settings), then the summary."""
    if seeds < 1:
        raise StemlmError(f"--seeds must be >= 1, got {seeds}")
    out = claim_out(Path(cfg.out), "bio")
    start = time.perf_counter()
    per_seed = []
    with log.bar(seeds, desc="seeds", unit="seed") as bar:
        for s in range(seeds):
            per_seed.append(_seed_result(cfg, s, out / f"seed{s}", log))
            bar.update()
    results = {
        "config": asdict(cfg),
        "seeds": seeds,
        "per_seed": per_seed,
        "summary": summarize_seeds([{k: v for k, v in r.items() if k != "seed"} for r in per_seed]),
        "wall_s": time.perf_counter() - start,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    from stemlm.experiments.bio_report import markdown

    (out / "results.md").write_text(markdown(results))
    return results


def run_command(options: BioOptions, log: ExperimentLog) -> dict:
    """`stemlm experiment bio`: the config's sizes checked, then `run_bio` over `options.seeds` seeds."""
    cfg = BioConfig(**{f.name: getattr(options, f.name) for f in fields(BioConfig)})
    if cfg.people < 4 or cfg.dense_steps < 1 or cfg.bios_per_person < 1:
        raise StemlmError("people must be >= 4, dense_steps and bios_per_person >= 1")
    return run_bio(cfg, log, seeds=options.seeds)


EXPERIMENT = Experiment(
    name="bio",
    help="synthetic biographies: memorisation vs extraction on held-out people, dense vs STEM",
    description="Train dense and STEM models at matched FLOPs on synthetic biographies (QA for half the "
    "people), then measure memorisation, QA extraction on the held-out half against chance, and knowledge "
    "bits per parameter, over several seeds.",
    options=BioOptions,
    run=run_command,
    text=results_file("results.md"),
    quick=QUICK,
    settable=True,
    fixed=("out",),
)
