"""The knowledge experiment: dense vs STEM on the fact world, over seeds, at matched FLOPs and matched tokens.

    stemlm experiment knowledge --out runs/knowledge                       # 3 seeds + lr sweep (~1.5 h, 2 cores)
    stemlm experiment knowledge --quick --seeds 2 --out runs/knowledge-q   # reduced budget, no sweep (129 s measured)
    stemlm experiment knowledge --preset tiny --steps 2000 --device auto   # scale-up path (GPU)

1. Data (per seed): the fact world's training statements (`fact_documents`) repeated `fact_repeats` times, then
   a slice of the embedded corpus whose tail is the trainer's held-out split (natural text only); a byte-level
   BPE trained on corpus + facts so most country names are single tokens.
2. Arms (`ARMS`, per seed): `dense` (the reference: `dense_steps`), `stem` at the dense run's training FLOPs,
   `stem_tokens` at the dense run's training tokens, and `dense_embed`, the dense control whose token embedding
   gets the STEM tables' lr multiplier and weight decay (`TrainConfig.embed_like_tables`), so "STEM beats
   dense" can be told from "a per-token table at lr x10 beats one at lr x1".
3. Tuning: every lr family (dense, stem, dense_embed) gets the same sweep (`lr_sweep`, 3 values) on a seed not
   used for the final runs (`sweep_seed`), scored by the trainer's held-out loss (natural text); each family's
   best lr is used for every final seed; the sweep is kept in the results. `--quick` skips it.
4. Fact recall per arm (exact greedy continuation on training and held-out templates, with chance levels),
   then edits (`score_edits`: the one call to swap for other edit metrics).
5. Seeds: `per_seed` holds every metric of every seed, plus the paired differences STEM - dense; `summary`
   holds mean and Student-t 95% interval over seeds of each (`stemlm.experiments.stats`).
Writes OUT/results.json, OUT/results.md and OUT/knowledge.png; seed s's runs live under OUT/seed<s>/ (a
finished seed is reused when the same command is rerun).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path

import torch
from tokenizers import Tokenizer

from stemlm.choices import DEVICES
from stemlm.data import EOT_TOKEN, embedded_texts, train_bpe
from stemlm.data.worlds.facts import fact_documents, fact_prompts
from stemlm.errors import StemlmError
from stemlm.evaluation.recall import fact_recall
from stemlm.experiments.contract import Experiment, ExperimentLog, positive_lrs, results_file
from stemlm.experiments.folders import claim_out, start_unit
from stemlm.experiments.stats import summarize_seeds
from stemlm.flags import setting
from stemlm.model.accounting import active_parameters, total_parameters, training_flops_per_token
from stemlm.model.config import ModelConfig

# arm -> (FFN kind, budget matched to the dense reference, TrainConfig overrides, lr family). Add an arm here.
ARMS: dict[str, tuple[str, str, dict, str]] = {
    "dense": ("dense", "reference", {}, "dense"),
    "stem": ("stem", "flops", {}, "stem"),
    "stem_tokens": ("stem", "tokens", {}, "stem"),
    "dense_embed": ("dense", "tokens", {"embed_like_tables": True}, "dense_embed"),
}
# The paired differences reported per seed: (name, arm, minus arm).
CONTRASTS = (
    ("stem-dense@flops", "stem", "dense"),
    ("stem-dense@tokens", "stem_tokens", "dense"),
    ("stem-dense_embed@tokens", "stem_tokens", "dense_embed"),
)


@dataclass
class KnowledgeConfig:
    out: str = setting("runs/knowledge", "output folder for runs, results.json, results.md")
    seeds: int = setting(3, "final seeds, seed..seed+N-1", metavar="N")
    arms: tuple[str, ...] = tuple(ARMS)
    relations: tuple[str, ...] = ("capital",)  # facts trained (and recall measured); edits use `edit_relation`
    edit_relation: str = "capital"
    fact_repeats: int = 30  # each training statement this many times (4 templates -> 120 exposures per fact)
    corpus_chars: int = 300_000  # characters of the embedded corpus mixed in (about 30% of the tokens)
    vocab_size: int = 3072
    # a model preset's shape (stemlm.model.presets) instead of the four fields below
    preset: str | None = setting(None, "take the model shape from this preset, for scale-up runs")
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    stem_layers: str = "odd"
    seq_len: int = 64
    # more, smaller steps: 16 x 320 recalled 75% (dense) where 32 x 160 recalled 1%
    batch_size: int = setting(16, "sequences per step", metavar="B")
    dense_steps: int = setting(  # the reference budget; the other arms match its FLOPs or its tokens
        320,
        "dense training steps (the reference budget); STEM gets the FLOP-matched count and a token-matched run",
        name="--steps",
        metavar="N",
    )
    lr: float = 3e-3  # every arm's lr when there is no sweep
    lr_sweep: tuple[float, ...] = setting(  # per lr family; () skips the sweep
        (1e-3, 3e-3, 1e-2),
        "lrs each lr family is tuned over on the sweep seed; 'none' skips the sweep",
        metavar="LR1,LR2,..",
        parse=positive_lrs,
    )
    sweep_seed: int = 1000  # the seed of the sweep's runs (never a final seed)
    seed: int = 0  # the first final seed; seed i of --seeds N is seed + i
    device: str = setting("cpu", "training device", one_of=DEVICES)
    edit_records: int = setting(100, "edit records per seed", name="--records", metavar="N")
    fluency_records: int = 10
    parallel: bool = setting(  # train two arms at once in two processes (one thread each)
        True, "train the arms one after the other", name="--serial", const=False
    )
    diagnostics: bool = setting(True, "skip the per-layer / strategy diagnostics", name="--no-diagnostics", const=False)
    extra: dict = field(default_factory=dict)


# The reduced budget of `--quick` (2 seeds of it: 129 s measured on 2 nearly idle cores; see docs/results.md).
QUICK = dict(
    seeds=2,
    dense_steps=160,
    fact_repeats=20,
    corpus_chars=120_000,
    edit_records=40,
    fluency_records=0,
    lr_sweep=(),
    diagnostics=False,
)


# ----------------------------------------------------------------------------------------------------------
# data and models
# ----------------------------------------------------------------------------------------------------------
def build_data(cfg: KnowledgeConfig, folder: Path) -> tuple[Tokenizer, Path]:
    """Write the training mixture as one text file under `folder` and train its tokenizer.

    One file, documents separated by `<|endoftext|>` as the trainer separates documents (so the EOT row is
    trained as in any pretraining run): the fact documents, then natural text. The trainer holds out the last
    10% of a single file's characters, so the held-out split is natural text only (a real held-out LM loss),
    every fact statement is trained on, and the split does not depend on where the file is (document names
    would)."""
    facts = EOT_TOKEN.join(fact_documents(repeats=cfg.fact_repeats, seed=cfg.seed, relations=cfg.relations))
    texts = embedded_texts("train")
    random.Random(cfg.seed).shuffle(texts)
    heldout_chars = (len(facts) + cfg.corpus_chars) // 9 + 1  # 10% of the whole file
    corpus = EOT_TOKEN.join(texts)[: cfg.corpus_chars + heldout_chars]
    if len(corpus) < cfg.corpus_chars + heldout_chars:
        raise StemlmError(f"corpus_chars={cfg.corpus_chars} exceeds the embedded corpus; lower it")
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "train.txt"
    data.write_text(facts + EOT_TOKEN + corpus, encoding="utf-8")
    tokenizer = train_bpe([corpus[: cfg.corpus_chars], facts], vocab_size=cfg.vocab_size)
    return tokenizer, data


def model_configs(cfg: KnowledgeConfig) -> dict[str, ModelConfig]:
    """{"dense", "stem"}: the configured shape (or the preset's), STEM in `stem_layers`, the tokenizer's vocab."""
    if cfg.preset:
        from stemlm.model.presets import get_preset

        shape = get_preset(cfg.preset)
        base = shape.replace(
            vocab_size=cfg.vocab_size, max_position_embeddings=max(256, cfg.seq_len), tie_word_embeddings=False
        )
    else:
        base = ModelConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            max_position_embeddings=max(256, cfg.seq_len),
        )
    base = base.replace(ffn="stem", ffn_layers=cfg.stem_layers)
    return {"dense": base.replace(ffn="dense"), "stem": base}


def matched_steps(configs: dict[str, ModelConfig], seq_len: int, dense_steps: int) -> dict[str, int]:
    """Steps per model giving the same training FLOPs as `dense_steps` of the dense model (same tokens/step)."""
    dense = training_flops_per_token(configs["dense"], seq_len)
    return {name: round(dense_steps * dense / training_flops_per_token(c, seq_len)) for name, c in configs.items()}


def arm_plan(cfg: KnowledgeConfig, configs: dict[str, ModelConfig]) -> dict[str, dict]:
    """Per arm: kind, steps, tokens, training FLOPs, parameters and the matching rule (same tokens per step)."""
    unknown = [a for a in cfg.arms if a not in ARMS]
    if unknown or "dense" not in cfg.arms or "stem" not in cfg.arms:
        raise StemlmError(f"arms must include dense and stem, from {', '.join(ARMS)}; got {','.join(cfg.arms)}")
    flops_steps = matched_steps(configs, cfg.seq_len, cfg.dense_steps)
    plan = {}
    for arm in cfg.arms:
        kind, match, overrides, family = ARMS[arm]
        steps = flops_steps[kind] if match == "flops" else cfg.dense_steps
        tokens = steps * cfg.seq_len * cfg.batch_size
        plan[arm] = {
            "kind": kind,
            "match": match,
            "family": family,
            "overrides": overrides,
            "steps": steps,
            "tokens": tokens,
            "train_flops": training_flops_per_token(configs[kind], cfg.seq_len) * tokens,
            "params_total": total_parameters(configs[kind]),
            "params_active": active_parameters(configs[kind])["backbone"],
        }
    return plan


def train_in_worker(name: str, model_config: dict, train_fields: dict, tokenizer_json: str) -> dict:
    # Runs in a worker process (bio.py uses it too): one thread, so two runs share the two cores without
    # oversubscribing them.
    torch.set_num_threads(1)
    from stemlm.train import TrainConfig, Trainer

    trainer = Trainer(
        ModelConfig.from_dict(model_config),
        TrainConfig(**train_fields),
        tokenizer=Tokenizer.from_str(tokenizer_json),
        progress=False,
    )
    return {"name": name, **trainer.fit()}


def train_all(jobs: list[tuple], workers: int, log: ExperimentLog) -> dict[str, dict]:
    """Every job of `train_in_worker` (bio.py's too), in `workers` processes when more than one; each run's fit
    summary by name, in job order. `log`'s run bar steps as each run finishes."""
    pool = None
    if workers > 1 and len(jobs) > 1:
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"))
    with log.bar(len(jobs), desc="runs", unit="run") as bar, pool or contextlib.nullcontext():
        results = {}
        for result in (pool.map if pool else map)(train_in_worker, *zip(*jobs, strict=True)):
            results[result["name"]] = result
            bar.update()
    return results


def train_arms(cfg, configs, plan, lrs, seed, tokenizer, data: Path, runs: Path, log) -> dict[str, dict]:
    """Train every arm of `plan` (lr from `lrs[family]`) on `data`; returns each run's fit summary by arm."""
    jobs = []
    for arm, p in plan.items():
        fields = dict(
            out=str(runs / arm),
            data=[str(data)],
            seq_len=cfg.seq_len,
            batch_size=cfg.batch_size,
            steps=p["steps"],
            lr=lrs[p["family"]],
            seed=seed,
            eval_every=0,
            threads=1 if cfg.parallel else None,
            device=cfg.device,
            **p["overrides"],
        )
        jobs.append((arm, configs[p["kind"]].to_dict(), fields, tokenizer.to_str()))
    return train_all(jobs, 2 if cfg.parallel else 1, log)


# ----------------------------------------------------------------------------------------------------------
# evaluation
# ----------------------------------------------------------------------------------------------------------
def recall_chance(relations: tuple[str, ...]) -> float:
    """Chance of exact recall by a model that knows the answer set but not the facts: 1 / distinct answers
    (mean over relations), the rate of guessing uniformly among the relation's possible objects."""
    prompts = fact_prompts("train", relations)
    rates = [1 / len({p.answer for p in prompts if p.relation == rel}) for rel in relations]
    return sum(rates) / len(rates)


def score_edits(cfg: KnowledgeConfig, models: dict, tokenizer: Tokenizer, log) -> dict:
    """The edit metrics of one seed's models: the single call to swap when the edit metrics change."""
    from stemlm.experiments.knowledge_edits import edit_results

    return edit_results(cfg, models, tokenizer, log)


# ----------------------------------------------------------------------------------------------------------
# one seed, the sweep, the whole experiment
# ----------------------------------------------------------------------------------------------------------
def _arm_row(p: dict, fit: dict, lr: float, table_lr_scale: float) -> dict:
    table_lr = lr * table_lr_scale
    return {
        **{k: p[k] for k in ("steps", "tokens", "train_flops", "params_total", "params_active")},
        "lr": lr,
        "table_lr": table_lr if p["kind"] == "stem" else None,
        "embed_lr": table_lr if p["overrides"].get("embed_like_tables") else lr,
        "train_loss": fit["train_loss"],
        "heldout_loss": fit["heldout_loss"],
        "train_s": fit["train_time_s"],
    }


def run_seed(cfg: KnowledgeConfig, seed: int, lrs: dict[str, float], folder: Path, log, edits: bool = True) -> dict:
    """Train every arm at `seed`, measure recall (and edits); one `per_seed` entry (also OUT/seed<s>/seed.json)."""
    from stemlm.checkpoint.runs import load_checkpoint
    from stemlm.train import TrainConfig

    scfg = dataclasses.replace(cfg, seed=seed)
    saved = folder / "seed.json"
    # What decides the seed's result (not where it is written, how many seeds run, or how many processes).
    settings = {k: v for k, v in asdict(scfg).items() if k not in ("out", "seeds", "parallel")}
    key = {"config": settings, "lrs": lrs, "edits": edits}
    if saved.is_file():
        previous = json.loads(saved.read_text())
        if previous.get("key") == json.loads(json.dumps(key)):
            log(f"seed {seed}: reused from {saved}")
            return previous["result"]
    start_unit(folder, key)  # refuses another command's seed; an interrupted one of ours starts over
    tokenizer, data = build_data(scfg, folder / "data")
    configs = model_configs(scfg)
    plan = arm_plan(scfg, configs)
    log(f"seed {seed}: training " + ", ".join(f"{a} ({p['steps']} steps)" for a, p in plan.items()) + " ...")
    fits = train_arms(scfg, configs, plan, lrs, seed, tokenizer, data, folder / "runs", log)
    models = {arm: load_checkpoint(fits[arm]["checkpoint"])[0].eval() for arm in plan}
    scale = TrainConfig().table_lr_scale
    arms = {arm: _arm_row(p, fits[arm], lrs[p["family"]], scale) for arm, p in plan.items()}
    for arm, model in models.items():
        arms[arm]["recall"] = fact_recall(model, tokenizer, cfg.relations)
    result = {"seed": seed, "arms": arms, "diff": contrasts(arms)}
    if edits:
        result["edits"] = score_edits(scfg, models, tokenizer, log)
    saved.write_text(json.dumps({"key": key, "result": result}, indent=1, default=str))
    return result


def contrasts(arms: dict[str, dict]) -> dict[str, dict]:
    """Paired per-seed differences (arm - other) of held-out loss and recall, for every contrast both ran."""
    out = {}
    for name, arm, other in CONTRASTS:
        if arm in arms and other in arms:
            a, b = arms[arm], arms[other]
            out[name] = {
                "heldout_loss": a["heldout_loss"] - b["heldout_loss"],
                "recall_train": a["recall"]["train"]["recall"] - b["recall"]["train"]["recall"],
                "recall_heldout": a["recall"]["heldout"]["recall"] - b["recall"]["heldout"]["recall"],
            }
    return out


def lr_sweep(cfg: KnowledgeConfig, out: Path, log) -> dict:
    """Each lr family's sweep at `sweep_seed` (every value of `lr_sweep`); best = lowest held-out loss."""
    families: dict[str, str] = {}  # lr family -> the first listed arm of it (stem: the FLOP-matched run)
    for arm in cfg.arms:
        families.setdefault(ARMS[arm][3], arm)
    trials: dict[str, dict[str, dict]] = {f: {} for f in families}
    with log.bar(len(cfg.lr_sweep), desc="lr sweep", unit="lr") as bar:
        for lr in cfg.lr_sweep:
            sub = dataclasses.replace(cfg, arms=tuple(families.values()))
            result = run_seed(sub, cfg.sweep_seed, dict.fromkeys(families, lr), out / f"lr{lr:g}", log, edits=False)
            for family, arm in families.items():
                r = result["arms"][arm]
                trials[family][f"{lr:g}"] = {
                    "lr": lr,
                    "heldout_loss": r["heldout_loss"],
                    "recall_train": r["recall"]["train"]["recall"],
                    "recall_heldout": r["recall"]["heldout"]["recall"],
                }
            bar.update()
    best = {f: min(t.values(), key=lambda r: r["heldout_loss"])["lr"] for f, t in trials.items()}
    return {"seed": cfg.sweep_seed, "criterion": "held-out loss (natural text)", "trials": trials, "best": best}


def planned_flops(cfg: KnowledgeConfig) -> float:
    """Training FLOPs of the whole experiment: every arm of every seed, plus the sweep's runs (one arm per lr
    family and lr); the cost estimate printed before training."""
    plan = arm_plan(cfg, model_configs(cfg))
    families = {p["family"]: p["train_flops"] for p in reversed(plan.values())}  # the first arm of each family
    return cfg.seeds * sum(p["train_flops"] for p in plan.values()) + len(cfg.lr_sweep) * sum(families.values())


def check_knowledge(cfg: KnowledgeConfig) -> None:
    """The fact world's settings, the counts and the training settings every arm gets: refused before any work."""
    from stemlm.data.worlds.facts import RELATIONS, check_relations
    from stemlm.train.config import TrainConfig

    try:
        check_relations(cfg.relations, "relations")
    except ValueError as exc:
        raise StemlmError(str(exc)) from None
    if cfg.edit_relation not in RELATIONS:
        raise StemlmError(f"edit_relation: unknown relation {cfg.edit_relation!r}; known: {', '.join(RELATIONS)}")
    if cfg.edit_relation not in cfg.relations:  # edits of facts never trained would move nothing the model holds
        raise StemlmError(
            f"edit_relation {cfg.edit_relation} is not among the trained relations ({','.join(cfg.relations)})"
        )
    for name in ("fact_repeats", "corpus_chars"):  # no facts, or no text: nothing the experiment measures
        if getattr(cfg, name) < 1:
            raise StemlmError(f"{name} must be a positive integer, got {getattr(cfg, name)}")
    for name, flag in (("edit_records", "--records"), ("fluency_records", "fluency_records")):
        if getattr(cfg, name) < 0:
            raise StemlmError(f"{flag} must be >= 0, got {getattr(cfg, name)}")
    if cfg.vocab_size < 257:
        raise StemlmError(f"vocab_size {cfg.vocab_size} is too small: byte-level BPE needs at least 256 + 1 tokens")
    TrainConfig(seq_len=cfg.seq_len, batch_size=cfg.batch_size, lr=cfg.lr, steps=1, data=["mixture"])  # its checks


def run_knowledge(cfg: KnowledgeConfig, log: ExperimentLog) -> dict:
    """The whole experiment over `cfg.seeds` seeds; writes and returns {config, sweep, per_seed, summary, ...}."""
    from stemlm.experiments.knowledge_report import write_report

    if cfg.seeds < 1:
        raise StemlmError(f"--seeds must be at least 1, got {cfg.seeds}")
    if cfg.dense_steps < 1:
        raise StemlmError(f"--steps must be positive, got {cfg.dense_steps}")
    if cfg.sweep_seed in range(cfg.seed, cfg.seed + cfg.seeds):
        raise StemlmError(f"sweep_seed {cfg.sweep_seed} is one of the final seeds; choose another")
    check_knowledge(cfg)
    flops = planned_flops(cfg)  # the arms and their model configs checked, before the folder is claimed
    start = time.perf_counter()
    out = claim_out(Path(cfg.out), "knowledge")
    log(f"knowledge: planned training FLOPs {flops:.3g} ({cfg.seeds} seed(s) and the lr sweep)")
    families = {ARMS[a][3] for a in cfg.arms}
    sweep = lr_sweep(cfg, out / "sweep", log) if cfg.lr_sweep else None
    lrs = {f: sweep["best"][f] if sweep else cfg.lr for f in families}
    per_seed = []
    with log.bar(cfg.seeds, desc="seeds", unit="seed") as bar:
        for i in range(cfg.seeds):
            seed = cfg.seed + i
            per_seed.append(run_seed(cfg, seed, lrs, out / f"seed{seed}", log))
            bar.update()
    results = {
        "config": asdict(cfg),
        "interval": "Student t over seeds (stemlm.experiments.stats)",
        "recall_chance": recall_chance(cfg.relations),
        "lrs": lrs,
        "sweep": sweep,
        "per_seed": per_seed,
        "summary": summarize_seeds([{k: v for k, v in s.items() if k != "seed"} for s in per_seed]),
        "wall_s": time.perf_counter() - start,
    }
    write_report(results, out)
    return results


def run_command(cfg: KnowledgeConfig, log: ExperimentLog) -> dict:
    """`stemlm experiment knowledge`: an unknown preset fails before any data is written."""
    if cfg.preset:
        from stemlm.model.presets import get_preset

        get_preset(cfg.preset)
    return run_knowledge(cfg, log)


JSON_KEYS = ("config", "interval", "recall_chance", "lrs", "sweep", "per_seed", "summary", "wall_s")
EXPERIMENT = Experiment(
    name="knowledge",
    help="dense vs STEM at matched FLOPs: fact recall and edit metrics",
    description="Train dense and STEM models on the fact world mixed with the embedded "
    "corpus at matched training FLOPs, then measure fact recall and edits.",
    options=KnowledgeConfig,
    run=run_command,
    text=results_file("results.md"),
    json=lambda cfg, results: {k: results[k] for k in JSON_KEYS},
    quick=QUICK,
    settable=True,
    fixed=("extra",),
)
