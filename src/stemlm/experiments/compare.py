"""Side-by-side experiment: dense, STEM, MoE, hash-MoE and PLE trained alike, then evaluated alike.

    stemlm experiment compare --kinds dense,stem,moe,hash_moe,ple --budget 300 --out runs/compare
    python -m stemlm.experiments.compare --budget 5e12 --match flops --out runs/compare

1. Data: one mixture for every kind (written to OUT/data/train.jsonl): a slice of the embedded corpus's train
   split, the fact world's statements (`fact_documents`) and passkey-retrieval documents (`niah.passkey_documents`)
   so small models can learn retrieval at all; the shipped tokenizer; the same seed.
2. Budget: `--budget 300` is 300 steps of the reference kind (dense when listed, else the first); `5e12`
   (or any value >= 1e9, or a `flops` suffix) is training FLOPs. `--match flops` (default) gives every kind
   the steps that spend those FLOPs (`stemlm.accounting.training_flops_per_token`); `--match active` trains
   every kind for the same steps (the paper's protocol: backbones of equal shape, so active parameters match
   up to what each FFN kind changes, which the table shows).
3. Training with the project trainer (`stemlm.train.Trainer`), kinds in parallel worker processes of one
   thread each; a finished kind (OUT/runs/<kind>.json) is reused when the command is rerun.
4. Evaluation of each model: held-out loss and bits per byte on the embedded held-out split
   (`evaluation.perplexity`), the shipped lm-eval tasks through lm-eval (`evaluation.lm_eval_adapter`),
   and a needle-in-a-haystack grid (`evaluation.niah`).
Writes OUT/results.json, OUT/report.md (the table), OUT/loss_vs_flops.png, OUT/accuracy.png and
OUT/niah_<kind>.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import random
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from stemlm.config import FFN_KINDS, ModelConfig
from stemlm.errors import StemlmError
from stemlm.experiments.compare_report import markdown_table, plot_report, summarize_kind


@dataclass
class CompareConfig:
    out: str = "runs/compare"
    kinds: tuple[str, ...] = ("dense", "stem", "moe", "hash_moe", "ple")
    budget: str = "200"  # steps of the reference kind, or training FLOPs (see parse_budget)
    match: str = "flops"  # flops | active
    # --- the shared backbone (every kind: this config with ffn=<kind>) ---
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    max_position_embeddings: int = 512
    stem_layers: str = "odd"  # the layers that get the kind's FFN; the others stay dense
    num_experts: int = 4
    ple_dim: int = 64
    model_overrides: list[str] = field(default_factory=list)  # "key=value" applied to every kind
    # --- training ---
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 3e-3
    seed: int = 0
    workers: int = 2  # kinds trained at once (one thread each); 1 trains in this process
    # --- data mixture ---
    corpus_chars: int = 2_000_000
    fact_repeats: int = 4
    passkey_docs: int = 1500
    passkey_lengths: tuple[int, ...] = (128, 160, 192)  # well under seq_len: most windows hold whole documents
    passkey_needles: tuple[int, ...] = (1, 2)
    # --- evaluation ---
    eval_limit: int | None = 100  # examples per lm-eval task (None: all)
    ppl_tokens: int = 30_000  # held-out tokens scored for the loss
    niah_lengths: tuple[int, ...] = (128, 256, 512)  # 512 is past the training length
    niah_depths: tuple[float, ...] = (0.0, 0.5, 1.0)
    niah_samples: int = 4
    niah_digits: int = 4

    def digest(self) -> str:
        """What a kind's result depends on (everything but the output folder, kinds and worker count)."""
        fields = {k: v for k, v in asdict(self).items() if k not in ("out", "kinds", "workers")}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


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

    unknown = [k for k in cfg.kinds if k not in FFN_KINDS]
    if unknown or not cfg.kinds:
        raise StemlmError(f"unknown kind(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(FFN_KINDS)}")
    if len(set(cfg.kinds)) != len(cfg.kinds):
        raise StemlmError(f"--kinds lists a kind twice: {','.join(cfg.kinds)}")
    base = ModelConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        stem_layers=cfg.stem_layers,
        num_experts=cfg.num_experts,
        ple_dim=cfg.ple_dim,
        ffn="stem",
    ).with_overrides(list(cfg.model_overrides))
    return {kind: fit_vocab(base, tokenizer).replace(ffn=kind) for kind in cfg.kinds}


def plan_steps(cfg: CompareConfig, configs: dict[str, ModelConfig]) -> dict[str, int]:
    """Training steps per kind for the budget under `cfg.match` (same tokens per step for every kind)."""
    from stemlm.accounting import training_flops_per_token

    if cfg.match not in ("flops", "active"):
        raise StemlmError(f"--match must be 'flops' or 'active', got {cfg.match!r}")
    tokens = cfg.seq_len * cfg.batch_size
    per_step = {k: training_flops_per_token(c, cfg.seq_len) * tokens for k, c in configs.items()}
    reference = "dense" if "dense" in configs else next(iter(configs))
    unit, value = parse_budget(cfg.budget)
    flops = value * per_step[reference] if unit == "steps" else value
    if cfg.match == "active":
        return dict.fromkeys(configs, max(1, round(flops / per_step[reference])))
    return {k: max(1, round(flops / f)) for k, f in per_step.items()}


def build_mixture(cfg: CompareConfig, folder: Path, tokenizer) -> dict[str, Any]:
    """Write OUT/data/train.jsonl (corpus slice + fact statements + passkey documents); returns token counts."""
    from stemlm.data import embedded_texts
    from stemlm.evaluation.niah import passkey_documents
    from stemlm.facts import fact_documents

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


def run_kind(kind: str, model_config: dict, steps: int, cfg_dict: dict, data: str, threads: int | None) -> dict:
    """Train one kind and evaluate it (runs in a worker process when `threads` is given)."""
    import torch

    from stemlm.accounting import active_parameters, total_parameters, training_flops_per_token
    from stemlm.data import default_tokenizer
    from stemlm.train import TrainConfig, Trainer

    if threads:
        torch.set_num_threads(threads)
    cfg = CompareConfig(**cfg_dict)
    config = ModelConfig.from_dict(model_config)
    train_cfg = TrainConfig(
        out=str(Path(cfg.out) / "runs" / kind),
        data=[data],
        seq_len=cfg.seq_len,
        batch_size=cfg.batch_size,
        steps=steps,
        lr=cfg.lr,
        seed=cfg.seed,
        eval_every=max(1, steps // 8),
        eval_batches=4,
        device="cpu",
        threads=threads,
    )
    trainer = Trainer(config, train_cfg, tokenizer=default_tokenizer(), progress=False)
    fit = trainer.fit()
    start = time.perf_counter()
    evaluation = _evaluate(trainer.model, trainer.tokenizer, cfg)
    flops_per_token = training_flops_per_token(config, cfg.seq_len)
    return {
        "kind": kind,
        "digest": cfg.digest(),
        "steps": steps,
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


def run_compare(cfg: CompareConfig, log=lambda msg: print(msg, file=sys.stderr)) -> dict[str, Any]:
    """The whole experiment; returns (and writes) the results."""
    from stemlm.data import default_tokenizer

    start = time.perf_counter()
    out = Path(cfg.out)
    tokenizer = default_tokenizer()
    configs = model_configs(cfg, tokenizer)
    steps = plan_steps(cfg, configs)
    too_long = [n for n in cfg.niah_lengths if n > cfg.max_position_embeddings]
    if too_long:
        raise StemlmError(f"NIAH length {max(too_long)} exceeds max_position_embeddings={cfg.max_position_embeddings}")
    log(f"compare: steps per kind {steps} ({cfg.match}-matched, budget {cfg.budget})")
    mixture = build_mixture(cfg, out / "data", tokenizer)
    log(f"compare: training mixture tokens {mixture}")
    _warm_shards(out / "data" / "train.jsonl", tokenizer)
    results: dict[str, dict] = {}
    todo = []
    for kind in cfg.kinds:
        saved = out / "runs" / f"{kind}.json"
        previous = json.loads(saved.read_text()) if saved.is_file() else {}
        if previous.get("digest") == cfg.digest() and previous.get("steps") == steps[kind]:
            results[kind] = previous
            log(f"compare: {kind} reused from {saved}")
        else:
            todo.append(kind)
    for kind in todo:  # an unfinished run of an interrupted experiment starts over
        shutil.rmtree(out / "runs" / kind, ignore_errors=True)
    cfg_dict = asdict(cfg)
    jobs = [(k, configs[k].to_dict(), steps[k], cfg_dict, str(out / "data" / "train.jsonl")) for k in todo]

    def finished(r: dict[str, Any]) -> None:  # saved at once, so an interruption keeps every finished kind
        (out / "runs" / f"{r['kind']}.json").write_text(json.dumps(r, indent=2))
        results[r["kind"]] = r
        log(f"compare: {r['kind']}: {r['steps']} steps in {r['fit']['wall_s']:.0f} s, evaluated in {r['eval_s']:.0f} s")

    if cfg.workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(max_workers=min(cfg.workers, len(jobs)), mp_context=get_context("spawn")) as pool:
            for future in as_completed([pool.submit(run_kind, *job, 1) for job in jobs]):
                finished(future.result())
    else:
        for job in jobs:
            finished(run_kind(*job, None))
    ordered = [results[k] for k in cfg.kinds]
    rows = [summarize_kind(r) for r in ordered]
    report = {
        "config": asdict(cfg),
        "steps": steps,
        "mixture_tokens": mixture,
        "rows": rows,
        "kinds": ordered,
        "wall_s": time.perf_counter() - start,
    }
    (out / "results.json").write_text(json.dumps(report, indent=2))
    plots = plot_report(ordered, out)
    (out / "report.md").write_text(
        f"# Side-by-side comparison ({cfg.match}-matched, budget {cfg.budget})\n\n"
        + markdown_table(rows)
        + "\n"
        + "".join(f"![{p.stem}]({p.name})\n" for p in plots)
    )
    return report


def _csv(kind: type):
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {kind.__name__}") from None

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The experiment's flags (used by `stemlm experiment compare` and `python -m stemlm.experiments.compare`)."""
    d = CompareConfig()

    def add(flag: str, help_text: str, **kw: Any) -> None:
        default = kw.setdefault("default", getattr(d, kw.get("dest") or flag[2:].replace("-", "_")))
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        parser.add_argument(flag, help=f"{help_text} (default: {shown})" if shown != [] else help_text, **kw)

    add("--kinds", "FFN kinds to compare", type=_csv(str), metavar="K1,K2")
    add(
        "--budget",
        "steps of the reference kind (dense, else the first), or training FLOPs if >= 1e9",
        metavar="STEPS|FLOPS",
    )
    add(
        "--match",
        "flops: each kind gets the steps that spend the budget; active: the same steps for all",
        choices=("flops", "active"),
    )
    add("--out", "report folder", metavar="DIR")
    add("--hidden-size", "backbone width", type=int, metavar="D")
    add("--intermediate-size", "FFN width d_ff", type=int, metavar="F")
    add("--layers", "decoder layers", dest="num_hidden_layers", type=int, metavar="N")
    add("--stem-layers", "layers given the kind's FFN, the others stay dense", metavar="SPEC")
    add(
        "--set",
        "override a model config field for every kind (repeatable)",
        dest="model_overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
    )
    add("--seq-len", "training sequence length", type=int, metavar="L")
    add("--batch-size", "sequences per step", type=int, metavar="B")
    add("--lr", "peak learning rate", type=float)
    add("--seed", "seed of data, initialisation and evaluation sampling", type=int)
    add("--workers", "kinds trained at once, one thread each; 1 trains in this process", type=int, metavar="N")
    add("--corpus-chars", "characters of the embedded corpus in the mixture", type=int, metavar="N")
    add("--fact-repeats", "repeats of each fact statement in the mixture", type=int, metavar="N")
    add("--passkey-docs", "passkey-retrieval documents in the mixture", type=int, metavar="N")
    add("--eval-limit", "examples per lm-eval task", type=int, metavar="N")
    add("--ppl-tokens", "held-out tokens scored for the loss", type=int, metavar="N")
    add("--niah-lengths", "needle-in-a-haystack context lengths", type=_csv(int), metavar="L1,L2")
    add("--niah-samples", "needle-in-a-haystack samples per cell", type=int, metavar="N")


def config_from_args(args: argparse.Namespace) -> CompareConfig:
    names = {f.name for f in dataclasses.fields(CompareConfig)}
    return CompareConfig(**{k: v for k, v in vars(args).items() if k in names})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="dense / STEM / MoE / hash-MoE / PLE side by side")
    add_arguments(parser)
    run_compare(config_from_args(parser.parse_args()))
