"""Side-by-side experiment: any of the registered kinds (and controls) trained alike over seeds, evaluated alike.

    stemlm experiment compare --kinds dense,stem,moe,hash_moe,ple --budget 300 --out runs/compare
    stemlm experiment compare --quick --seeds 2 --kinds dense,stem --json    # reduced budget, no lr sweep
    stemlm experiment compare --quick --layers 6 --kinds dense,engram,value_embed --variants default,reference
    stemlm experiment compare --preset tiny --budget 2000 --device auto      # scale-up path (GPU)

1. Data (per seed): one mixture for every kind (OUT/seed<s>/data/train.jsonl): a slice of the embedded corpus's
   train split, the fact world's statements and passkey-retrieval documents; the shipped tokenizer.
2. Budget, reported both ways (`--match both`, the default): `--budget 300` is 300 steps of the reference kind
   (dense when listed, else the first), `5e12` (>= 1e9 or a `flops` suffix) is training FLOPs. Matched FLOPs:
   every kind gets the steps that spend the reference's FLOPs (`stemlm.model.accounting.training_flops_per_token`);
   matched tokens: every kind trains the reference's steps (same tokens per step). A kind whose step count is
   the same under both is trained once.
3. Kinds: every kind of the registry (`stemlm.model.kinds`, i.e. `stemlm.model.config.FFN_KINDS`), plus the controls
   in `VARIANTS` (`dense_embed`: dense with its token embedding at the STEM tables' lr multiplier and weight decay),
   plus a kind's model variant as an arm of its own: `engram-reference` is `engram` with `engram_variant=reference`
   (any kind with a `<kind>_variant` field; `--variants reference` adds one after each such kind listed), with the
   settings the kind declares that variant needs (`Kind.variant_settings`: value_embed-reference's layers). An arm's
   name is its label in every table, plot and file name.
4. Tuning: each kind gets the same lr sweep (`lr_sweep`, 3 values) at the FLOP-matched budget on `sweep_seed`
   (never a final seed), scored by the trainer's held-out loss (10% of the mixture's documents: the
   validation split); the best lr is used for every final seed and the sweep is kept in the results.
5. Evaluation of each model, one set per measure: held-out loss and bits per byte on the embedded held-out
   split (`evaluation.perplexity`, first `ppl_tokens` tokens, window `seq_len`; the table and the plot show
   this same number), the shipped lm-eval tasks, and a needle-in-a-haystack grid (`evaluation.niah`).
6. Seeds: `per_seed` holds each seed's rows per match and the paired differences to dense; `summary` the mean
   and Student-t 95% interval over seeds (`stemlm.experiments.stats`). Finished runs are reused on a rerun.
Writes OUT/results.json, OUT/report.md, OUT/loss_vs_flops.png, OUT/accuracy.png and OUT/niah_<kind>.png.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from stemlm.choices import DEVICES
from stemlm.errors import StemlmError
from stemlm.experiments.compare_checks import check_compare, variant_field
from stemlm.experiments.compare_report import summarize_kind, write_report
from stemlm.experiments.contract import Experiment, ExperimentLog, positive_lrs, results_file
from stemlm.experiments.folders import claim_out, start_unit
from stemlm.flags import setting
from stemlm.model.config import FFN_KINDS, ModelConfig
from stemlm.model.kinds.registry import get_kind

# Controls trained like a kind: name -> (FFN kind, TrainConfig overrides). Add a control here.
VARIANTS: dict[str, tuple[str, dict]] = {"dense_embed": ("dense", {"embed_like_tables": True})}


@dataclass
class CompareConfig:
    out: str = setting("runs/compare", "report folder", metavar="DIR")
    kinds: tuple[str, ...] = setting(
        ("dense", "stem", "moe", "hash_moe", "ple"),
        f"kinds to compare, from {', '.join((*FFN_KINDS, *VARIANTS))}",
        metavar="K1,K2",
    )
    variants: tuple[str, ...] = setting(
        (),
        "model variants run as arms of their own beside each kind's default: 'reference' adds <kind>-reference "
        "after each listed kind with a <kind>_variant setting ('default': the kind itself)",
        metavar="V1,V2",
    )
    budget: str = setting(  # steps of the reference kind, or training FLOPs (see parse_budget)
        "200", "steps of the reference kind (dense, else the first), or training FLOPs if >= 1e9", metavar="STEPS|FLOPS"
    )
    match: str = setting(
        "both",
        "flops: each kind gets the steps that spend the budget; tokens (or active): the same steps for all; "
        "both: report both",
        one_of=("flops", "tokens", "active", "both"),
    )
    seeds: int = setting(3, "final seeds (seed, seed+1, ...); mean and 95%% t interval over them", metavar="N")
    # --- the shared backbone (every kind: this config with ffn=<kind>) ---
    preset: str | None = setting(  # a model preset's shape (stemlm.model.presets) instead of the size fields below
        None, "take the backbone shape from this preset (stemlm info --presets), e.g. for GPU"
    )
    hidden_size: int = setting(128, "backbone width", metavar="D")
    intermediate_size: int = setting(384, "FFN width d_ff", metavar="F")
    num_hidden_layers: int = setting(4, "decoder layers", name="--layers", metavar="N")
    num_attention_heads: int = 4
    max_position_embeddings: int = 512
    ffn_layers: str = setting(
        "odd", "layers given the kind's FFN, the others stay dense", metavar="SPEC", aliases=("--stem-layers",)
    )
    num_experts: int = 4
    ple_dim: int = 64
    model_overrides: list[str] = setting(  # "key=value" applied to every kind
        [], "override a model config field for every kind (repeatable)", name="--set", metavar="KEY=VALUE", append=True
    )
    # --- training ---
    seq_len: int = setting(256, "training sequence length", metavar="L")
    batch_size: int = setting(8, "sequences per step", metavar="B")
    lr: float = setting(3e-3, "peak learning rate when there is no sweep")
    lr_sweep: tuple[float, ...] = setting(  # per kind; () skips the sweep
        (1e-3, 3e-3, 1e-2),
        "lrs each kind is tuned over on the sweep seed; 'none': no sweep",
        metavar="LR1,LR2",
        parse=positive_lrs,
    )
    sweep_seed: int = 1000
    seed: int = setting(  # seed i of --seeds N is seed + i
        0, "first final seed (data, initialisation and evaluation sampling)"
    )
    device: str = setting("cpu", "training and evaluation device", one_of=DEVICES)
    workers: int = setting(2, "runs trained at once, one thread each; 1 trains in this process", metavar="N")
    # --- data mixture ---
    corpus_chars: int = setting(2_000_000, "characters of the embedded corpus in the mixture", metavar="N")
    fact_repeats: int = setting(4, "repeats of each fact statement in the mixture", metavar="N")
    passkey_docs: int = setting(1500, "passkey-retrieval documents in the mixture", metavar="N")
    passkey_lengths: tuple[int, ...] = (128, 160, 192)  # well under seq_len: most windows hold whole documents
    passkey_needles: tuple[int, ...] = (1, 2)
    # --- evaluation ---
    eval_limit: int | None = setting(100, "examples per lm-eval task (none: all)", metavar="N")
    ppl_tokens: int = setting(30_000, "held-out tokens scored for the loss", metavar="N")
    niah_lengths: tuple[int, ...] = setting(  # 512 is past the training length
        (128, 256, 512), "needle-in-a-haystack context lengths", metavar="L1,L2"
    )
    niah_depths: tuple[float, ...] = (0.0, 0.5, 1.0)
    niah_samples: int = setting(4, "needle-in-a-haystack samples per cell", metavar="N")
    niah_digits: int = 4

    def digest(self) -> str:
        """What a run's result depends on besides its kind, steps, lr and seed (which name its file)."""
        skip = ("out", "kinds", "variants", "workers", "seeds", "match")
        fields = {k: v for k, v in asdict(self).items() if k not in skip}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


# The reduced budget of `--quick` (2 seeds of dense,stem: 180 s measured on 2 nearly idle cores; see docs/results.md).
QUICK = dict(
    seeds=2,
    budget="60",
    lr_sweep=(),
    corpus_chars=300_000,
    passkey_docs=300,
    eval_limit=40,
    ppl_tokens=8000,
    niah_lengths=(128, 256),
    niah_samples=2,
)


def kind_names() -> tuple[str, ...]:
    return (*FFN_KINDS, *VARIANTS)


def split_arm(arm: str) -> tuple[str, str | None]:
    """`engram-reference` -> ("engram", "reference"); a plain kind or control -> (arm, None)."""
    if arm in kind_names():
        return arm, None
    kind, _, variant = arm.partition("-")
    if variant and variant_field(kind):
        return kind, variant
    choices = ", ".join((*kind_names(), *(f"{k}-<variant>" for k in FFN_KINDS if variant_field(k))))
    raise StemlmError(f"unknown kind {arm!r}; choose from {choices}")


def arms(cfg: CompareConfig) -> tuple[str, ...]:
    """The runs' labels: `cfg.kinds`, each followed by its `<kind>-<variant>` arm for every `cfg.variants` but
    "default" (the kind itself)."""
    out: list[str] = []
    for kind in cfg.kinds:
        out.append(kind)
        if variant_field(kind):
            out += [f"{kind}-{v}" for v in cfg.variants if v != "default" and f"{kind}-{v}" not in cfg.kinds]
    return tuple(out)


def arm_config(base: ModelConfig, arm: str) -> ModelConfig:
    """The shared backbone with the arm's FFN kind, and its variant (and what that variant needs) when it names one."""
    kind, variant = split_arm(arm)
    config = base.replace(ffn=VARIANTS.get(kind, (kind,))[0])
    if variant is None:
        return config
    settings = {variant_field(kind): variant, **get_kind(kind).variant_settings.get(variant, {})}
    try:
        return config.replace(**settings)
    except (ValueError, StemlmError) as err:
        given = ", ".join(f"{k}={v}" for k, v in settings.items())
        raise StemlmError(f"arm {arm} ({given}, on {config.num_hidden_layers} layers): {err}") from None


def parse_budget(text: str) -> tuple[str, float]:
    """("steps", n) or ("flops", x): a `steps` / `flops` suffix decides; else values >= 1e9 are FLOPs."""
    raw = str(text).strip().lower().replace("_", "")
    unit = "steps" if raw.endswith("steps") else "flops" if raw.endswith("flops") else None
    number = raw.removesuffix("steps").removesuffix("flops")
    try:
        value = float(number)
    except ValueError:
        raise StemlmError(f"--budget {text!r}: give steps (e.g. 300) or training FLOPs (e.g. 5e12)") from None
    if not math.isfinite(value) or value <= 0:
        raise StemlmError(f"--budget must be positive, got {text!r}")
    return (unit or ("flops" if value >= 1e9 else "steps")), value


def model_configs(cfg: CompareConfig, tokenizer) -> dict[str, ModelConfig]:
    """One config per kind: the shared backbone with `ffn=<kind>` (vocabulary fitted to the tokenizer)."""
    from stemlm.train import fit_vocab

    unknown = [k for k in cfg.kinds if k not in kind_names() and "-" not in k]
    if unknown or not cfg.kinds:
        raise StemlmError(f"unknown kind(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(kind_names())}")
    for arm in cfg.kinds:
        split_arm(arm)
    if len(set(cfg.kinds)) != len(cfg.kinds):
        raise StemlmError(f"--kinds lists a kind twice: {','.join(cfg.kinds)}")
    shape = {}
    if cfg.preset:
        from stemlm.model.presets import get_preset

        keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
        shape = {k: getattr(get_preset(cfg.preset), k) for k in keep}
    base = ModelConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        ffn_layers=cfg.ffn_layers,
        num_experts=cfg.num_experts,
        ple_dim=cfg.ple_dim,
        ffn="stem",
    )
    base = base.replace(**shape).with_overrides(list(cfg.model_overrides))
    base = fit_vocab(base, tokenizer)
    return {arm: arm_config(base, arm) for arm in arms(cfg)}


def matches(cfg: CompareConfig) -> list[str]:
    """The budget matchings reported: ["flops"], ["tokens"] or both."""
    table = {"flops": ["flops"], "tokens": ["tokens"], "active": ["tokens"], "both": ["flops", "tokens"]}
    if cfg.match not in table:
        raise StemlmError(f"--match must be one of flops, tokens, both, got {cfg.match!r}")
    return table[cfg.match]


def plan_steps(cfg: CompareConfig, configs: dict[str, ModelConfig], match: str | None = None) -> dict[str, int]:
    """Training steps per kind for the budget, FLOP- or token-matched (`match`, default the first of
    `matches(cfg)`); every kind trains the same tokens per step."""
    from stemlm.model.accounting import training_flops_per_token

    match = match or matches(cfg)[0]
    tokens = cfg.seq_len * cfg.batch_size
    per_step = {k: training_flops_per_token(c, cfg.seq_len) * tokens for k, c in configs.items()}
    reference = "dense" if "dense" in configs else next(iter(configs))
    unit, value = parse_budget(cfg.budget)
    flops = value * per_step[reference] if unit == "steps" else value
    if match in ("tokens", "active"):
        return dict.fromkeys(configs, max(1, round(flops / per_step[reference])))
    return {k: max(1, round(flops / f)) for k, f in per_step.items()}


def build_mixture(cfg: CompareConfig, folder: Path, tokenizer) -> dict[str, Any]:
    """Write OUT/data/train.jsonl (corpus slice + fact statements + passkey documents); returns token counts."""
    from stemlm.data import embedded_texts
    from stemlm.data.worlds.facts import fact_documents
    from stemlm.evaluation.niah import passkey_documents

    texts = embedded_texts("train")
    random.Random(cfg.seed).shuffle(texts)
    corpus, size = [], 0
    for text in texts:
        if size >= cfg.corpus_chars:
            break
        corpus.append(text[: cfg.corpus_chars - size])
        size += len(corpus[-1])
    parts = {
        "corpus": corpus,
        "facts": fact_documents(repeats=cfg.fact_repeats, seed=cfg.seed) if cfg.fact_repeats else [],
        "passkey": passkey_documents(
            tokenizer,
            cfg.passkey_docs,
            cfg.passkey_lengths,
            needles=cfg.passkey_needles,
            digits=cfg.niah_digits,
            seed=cfg.seed + 1234,
        )
        if cfg.passkey_docs
        else [],
    }
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "train.jsonl", "w", encoding="utf-8") as f:
        for text in (t for group in parts.values() for t in group):
            if text.strip():
                f.write(json.dumps({"text": text}) + "\n")
    return {name: sum(len(e.ids) for e in tokenizer.encode_batch(group)) for name, group in parts.items()}


def _warm_shards(data: Path, tokenizer) -> None:
    # Tokenize the mixture once here, with the trainer's own split, so the workers find the cached shards
    # instead of all tokenizing the same text at the same time.
    from stemlm.data import TokenDataset, load_corpus

    for texts in load_corpus([data]):
        if texts:
            TokenDataset.from_texts(texts, tokenizer)


def _evaluate(model, tokenizer, cfg: CompareConfig) -> dict[str, Any]:
    from stemlm.data import embedded_texts
    from stemlm.evaluation.lm_eval_adapter import StemlmLM, run_lm_eval, summarize_results
    from stemlm.evaluation.niah import model_answerer, run_niah
    from stemlm.evaluation.perplexity import evaluate_perplexity

    model.eval()
    ppl = evaluate_perplexity(
        model, tokenizer, embedded_texts("heldout"), window=cfg.seq_len, max_tokens=cfg.ppl_tokens
    )
    lm = StemlmLM(model, tokenizer, max_length=cfg.seq_len)
    tasks = summarize_results(run_lm_eval(lm, None, limit=cfg.eval_limit, seed=cfg.seed))
    niah = run_niah(
        model_answerer(model, tokenizer),
        tokenizer,
        cfg.niah_lengths,
        cfg.niah_depths,
        samples=cfg.niah_samples,
        digits=cfg.niah_digits,
        seed=cfg.seed,
        max_context=model.config.max_position_embeddings,
    )
    return {"heldout": ppl.to_dict(), "tasks": tasks, "niah": niah}


def _has_tables(model) -> bool:
    """Whether the table optimizer group (its own lr) trained anything: token, n-gram or memory tables."""
    return bool(model.lookup_tables())


def run_kind(job: dict[str, Any], threads: int | None) -> dict[str, Any]:
    """Train one run (`job`: kind, model config, steps, lr, seed, overrides, data, run folder) and evaluate it
    unless `job["evaluate"]` is false (runs in a worker process when `threads` is given)."""
    import torch

    from stemlm.data import default_tokenizer
    from stemlm.model.accounting import active_parameters, total_parameters, training_flops_per_token
    from stemlm.train import TrainConfig, Trainer

    if threads:
        torch.set_num_threads(threads)
    cfg = CompareConfig(**job["cfg"])
    config = ModelConfig.from_dict(job["model"])
    train_cfg = TrainConfig(
        out=job["run_dir"],
        data=[job["data"]],
        seq_len=cfg.seq_len,
        batch_size=cfg.batch_size,
        steps=job["steps"],
        lr=job["lr"],
        seed=job["seed"],
        eval_every=0,  # one held-out evaluation at the end (the sweep's criterion); the report uses _evaluate's
        eval_batches=4,
        device=cfg.device,
        threads=threads,
        **job["overrides"],
    )
    trainer = Trainer(config, train_cfg, tokenizer=default_tokenizer(), progress=False)
    fit = trainer.fit()
    start = time.perf_counter()
    evaluation = _evaluate(trainer.model, trainer.tokenizer, cfg) if job["evaluate"] else {}
    flops_per_token = training_flops_per_token(config, cfg.seq_len)
    return {
        **{k: job[k] for k in ("kind", "steps", "lr", "seed", "digest")},
        "table_lr": train_cfg.table_peak_lr if _has_tables(trainer.model) else None,
        "embed_lr": train_cfg.table_peak_lr if train_cfg.embed_like_tables else train_cfg.lr,
        "tokens": fit["tokens_seen"],
        "model": config.to_dict(),
        "params_total": total_parameters(config),
        "params_active": active_parameters(config)["backbone"],
        "params_active_with_rows": active_parameters(config)["with_rows"],
        "train_flops_per_token": flops_per_token,
        "train_flops": flops_per_token * fit["tokens_seen"],
        "fit": fit,
        "eval_s": time.perf_counter() - start,
        **evaluation,
    }


def run_jobs(cfg: CompareConfig, seed: int, runs: dict[str, tuple], folder: Path, tokenizer, log) -> dict[str, dict]:
    """Build seed `seed`'s mixture under `folder` and train (and evaluate) every run of `runs`
    (name -> (kind, config, steps, lr, evaluate)); a finished run (folder/runs/<name>.json) is reused."""
    scfg = dataclasses.replace(cfg, seed=seed)
    mixture = build_mixture(scfg, folder / "data", tokenizer)
    log(f"compare: seed {seed}: training mixture tokens {mixture}")
    _warm_shards(folder / "data" / "train.jsonl", tokenizer)
    results: dict[str, dict] = {}
    jobs = []
    for name, (kind, config, steps, lr, evaluate) in runs.items():
        saved = folder / "runs" / f"{name}.json"
        job = {
            "kind": kind,
            "model": config.to_dict(),
            "steps": steps,
            "lr": lr,
            "seed": seed,
            "evaluate": evaluate,
            "overrides": VARIANTS.get(split_arm(kind)[0], (kind, {}))[1],
            "cfg": asdict(scfg),
            "digest": scfg.digest(),
            "data": str(folder / "data" / "train.jsonl"),
            "run_dir": str(folder / "runs" / name),
        }
        previous = json.loads(saved.read_text()) if saved.is_file() else {}
        if all(previous.get(k) == job[k] for k in ("digest", "steps", "lr")) and (
            previous.get("heldout") or not evaluate
        ):
            results[name] = previous
            log(f"compare: seed {seed}: {name} reused from {saved}")
        else:
            # refuses another command's run; an interrupted one of ours starts over
            settings = {k: job[k] for k in ("kind", "digest", "steps", "lr", "evaluate")}
            start_unit(Path(job["run_dir"]), settings, record=folder / "runs" / f"{name}.started.json")
            jobs.append((name, job))

    def finished(name: str, r: dict[str, Any]) -> None:  # saved at once, so an interruption keeps it
        (folder / "runs" / f"{name}.json").write_text(json.dumps(r, indent=2))
        results[name] = r
        log(f"compare: seed {seed}: {name}: {r['steps']} steps in {r['fit']['wall_s']:.0f} s, eval {r['eval_s']:.0f} s")

    with log.bar(len(jobs), desc="runs", unit="run") as bar:
        if cfg.workers > 1 and len(jobs) > 1:
            with ProcessPoolExecutor(max_workers=min(cfg.workers, len(jobs)), mp_context=get_context("spawn")) as pool:
                futures = {pool.submit(run_kind, job, 1): name for name, job in jobs}
                for future in as_completed(futures):
                    finished(futures[future], future.result())
                    bar.update()
        else:
            for name, job in jobs:
                finished(name, run_kind(job, None))
                bar.update()
    return results


def lr_sweep(cfg: CompareConfig, configs, steps: dict[str, int], out: Path, tokenizer, log) -> dict[str, Any]:
    """Every kind at every lr of `cfg.lr_sweep` on `sweep_seed` at `steps`; best = lowest validation loss."""
    runs = {
        f"{kind}-lr{lr:g}": (kind, configs[kind], steps[kind], lr, False) for kind in configs for lr in cfg.lr_sweep
    }
    done = run_jobs(cfg, cfg.sweep_seed, runs, out, tokenizer, log)
    trials = {
        kind: {
            f"{lr:g}": {"lr": lr, "heldout_loss": done[f"{kind}-lr{lr:g}"]["fit"]["heldout_loss"]}
            for lr in cfg.lr_sweep
        }
        for kind in configs
    }
    best = {k: min(t.values(), key=lambda r: r["heldout_loss"])["lr"] for k, t in trials.items()}
    criterion = "trainer held-out loss (10% of the mixture's documents: the validation split)"
    return {"seed": cfg.sweep_seed, "steps": steps, "criterion": criterion, "trials": trials, "best": best}


def planned_flops(cfg: CompareConfig, configs: dict[str, ModelConfig], plans: dict[str, dict[str, int]]) -> float:
    """Training FLOPs of the whole experiment: every distinct run of every seed, plus the lr sweep (the cost
    estimate printed before training; evaluation is extra and small at these budgets)."""
    from stemlm.model.accounting import training_flops_per_token

    tokens = cfg.seq_len * cfg.batch_size
    per_run = {
        (k, n): training_flops_per_token(configs[k], cfg.seq_len) * tokens * n
        for p in plans.values()
        for k, n in p.items()
    }
    first = next(iter(plans.values()))
    sweep = sum(per_run[(k, first[k])] for k in configs) * len(cfg.lr_sweep)
    return cfg.seeds * sum(per_run.values()) + sweep


def seed_entry(seed: int, plans: dict[str, dict[str, int]], done: dict[str, dict]) -> dict[str, Any]:
    """One `per_seed` entry: the report row of every kind per match, each kind minus the reference, and each
    variant arm minus its kind's default arm (`engram-reference-engram`) when both ran."""
    entry: dict[str, Any] = {"seed": seed, "diff": {}}
    for match, steps in plans.items():
        rows = {k: json.loads(json.dumps(summarize_kind(done[f"{k}-{n}steps"]))) for k, n in steps.items()}
        entry[match] = rows
        ref = "dense" if "dense" in rows else next(iter(rows))
        entry["diff"][match] = {
            f"{k}-{ref}": {
                m: _minus(rows[k][m], rows[ref][m]) for m in ("heldout_loss", "heldout_bpb", "mean_accuracy", "niah")
            }
            for k in rows
            if k != ref
        }
        for arm in rows:  # a variant arm beside its kind's default arm: their paired difference as well
            kind = split_arm(arm)[0]
            if kind != arm and kind in rows and kind != ref:
                entry["diff"][match][f"{arm}-{kind}"] = {
                    m: _minus(rows[arm][m], rows[kind][m])
                    for m in ("heldout_loss", "heldout_bpb", "mean_accuracy", "niah")
                }
    return entry


def _minus(a, b):
    return None if a is None or b is None else a - b


def run_compare(cfg: CompareConfig, log: ExperimentLog) -> dict[str, Any]:
    """The whole experiment over `cfg.seeds` seeds; returns (and writes) {config, sweep, per_seed, summary, ...}."""
    from stemlm.data import default_tokenizer
    from stemlm.experiments.stats import summarize_seeds

    start = time.perf_counter()
    out = Path(cfg.out)
    tokenizer = default_tokenizer()
    configs = model_configs(cfg, tokenizer)
    plans = {match: plan_steps(cfg, configs, match) for match in matches(cfg)}
    if cfg.seeds < 1:
        raise StemlmError(f"--seeds must be at least 1, got {cfg.seeds}")
    if cfg.sweep_seed in range(cfg.seed, cfg.seed + cfg.seeds):
        raise StemlmError(f"sweep_seed {cfg.sweep_seed} is one of the final seeds; choose another")
    too_long = [n for n in cfg.niah_lengths if n > configs[cfg.kinds[0]].max_position_embeddings]
    if too_long:
        raise StemlmError(f"NIAH length {max(too_long)} exceeds max_position_embeddings={cfg.max_position_embeddings}")
    out = claim_out(out, "compare")
    log(f"compare: steps per kind {plans} (budget {cfg.budget}), {cfg.seeds} seed(s)")
    log(f"compare: planned training FLOPs {planned_flops(cfg, configs, plans):.3g} (every seed and the sweep)")
    sweep = lr_sweep(cfg, configs, next(iter(plans.values())), out / "sweep", tokenizer, log) if cfg.lr_sweep else None
    lrs = {k: sweep["best"][k] if sweep else cfg.lr for k in configs}
    runs = {
        f"{k}-{steps[k]}steps": (k, configs[k], steps[k], lrs[k], True) for steps in plans.values() for k in configs
    }
    per_seed, raw = [], []
    with log.bar(cfg.seeds, desc="seeds", unit="seed") as bar:
        for i in range(cfg.seeds):
            seed = cfg.seed + i
            done = run_jobs(cfg, seed, runs, out / f"seed{seed}", tokenizer, log)
            per_seed.append(seed_entry(seed, plans, done))
            raw.append(done)
            bar.update()
    report = {
        "config": asdict(cfg),
        "interval": "Student t over seeds (stemlm.experiments.stats)",
        "steps": plans,
        "lrs": lrs,
        "sweep": sweep,
        "per_seed": per_seed,
        "summary": summarize_seeds([{k: v for k, v in s.items() if k != "seed"} for s in per_seed]),
        "wall_s": time.perf_counter() - start,
    }
    write_report(report, raw, out)
    return report


def run_command(cfg: CompareConfig, log: ExperimentLog) -> dict:
    """`stemlm experiment compare`: bad options (`compare_checks`) and an unknown preset fail before any data is
    written."""
    check_compare(cfg)
    if cfg.preset:
        from stemlm.model.presets import get_preset

        get_preset(cfg.preset)
    return run_compare(cfg, log)


EXPERIMENT = Experiment(
    name="compare",
    help="dense vs STEM vs MoE vs hash-MoE vs PLE over seeds, at matched FLOPs and matched tokens",
    description="Train each FFN kind on the same data, tokenizer and seed at a matched training budget, "
    "evaluate each (held-out loss, lm-eval tasks, needle in a haystack) and write a report folder.",
    options=CompareConfig,
    run=run_command,
    text=results_file("report.md"),
    json=lambda cfg, report: {"out": cfg.out, **report},
    done=lambda cfg, report: f"report folder: {cfg.out} ({report['wall_s']:.0f} s)",
    quick=QUICK,
)
