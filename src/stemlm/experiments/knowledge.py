"""The knowledge experiment: dense vs STEM on the fact world at matched training FLOPs, then edits.

    stemlm experiment knowledge --out runs/knowledge            # default: 6-8 min on two shared CPU cores
    python -m stemlm.experiments.knowledge --out runs/knowledge

1. Data: the fact world's training statements (`fact_documents`, relation `capital` by default) repeated
   `fact_repeats` times, then a slice of the embedded corpus (Shakespeare + Austen) whose tail is the
   held-out split (so held-out loss is on natural text); a byte-level BPE
   trained on corpus + facts so most country names are single tokens (multi-token names made the prototype's
   edits messy), which still leaves multi-word names ("United Kingdom") to exercise the mismatch strategies.
2. Training: a dense model and its STEM twin (STEM in the odd layers) with the project trainer, the STEM one
   for as many steps as give the dense run's training FLOPs (`stemlm.accounting.training_flops_per_token`).
3. Fact recall: exact greedy continuation on the training templates and on held-out templates.
4. Edits (positional, `stemlm.edit.evaluate`): STEM rows, embedding rows, both, and the dense model's
   embedding rows as the control; then diagnostics for why efficacy is what it is: one STEM layer at a time,
   the global (table) form, and pad rows / strategies on records whose names differ in length.
Writes OUT/results.json and OUT/results.md (tables), plus the two training runs under OUT/runs/.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path

import torch
from tokenizers import Tokenizer

from stemlm.accounting import training_flops_per_token
from stemlm.config import ModelConfig
from stemlm.data import EOT_TOKEN, embedded_texts, train_bpe
from stemlm.edit.evaluate import evaluate_edits, summarize
from stemlm.edit.report import format_edit_table
from stemlm.edit.spans import entity_ids
from stemlm.errors import StemlmError
from stemlm.facts import edit_records, fact_documents, fact_prompts


@dataclass
class KnowledgeConfig:
    out: str = "runs/knowledge"
    relations: tuple[str, ...] = ("capital",)  # facts trained (and recall measured); edits use `edit_relation`
    edit_relation: str = "capital"
    fact_repeats: int = 30  # each training statement this many times (4 templates -> 120 exposures per fact)
    corpus_chars: int = 300_000  # characters of the embedded corpus mixed in (about 30% of the tokens)
    vocab_size: int = 3072
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    stem_layers: str = "odd"
    seq_len: int = 64
    batch_size: int = 16  # more, smaller steps: 16 x 320 recalled 75% (dense) where 32 x 160 recalled 1%
    dense_steps: int = 320  # the STEM run gets the steps that match this run's training FLOPs
    lr: float = 3e-3
    seed: int = 0
    edit_records: int = 100
    fluency_records: int = 10
    parallel: bool = True  # train the two models in two processes (one thread each)
    diagnostics: bool = True
    extra: dict = field(default_factory=dict)


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
    base = ModelConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        max_position_embeddings=max(256, cfg.seq_len),
        ffn="stem",
        stem_layers=cfg.stem_layers,
    )
    return {"dense": base.replace(ffn="dense"), "stem": base}


def matched_steps(configs: dict[str, ModelConfig], seq_len: int, dense_steps: int) -> dict[str, int]:
    """Steps per model giving the same training FLOPs as `dense_steps` of the dense model (same tokens/step)."""
    dense = training_flops_per_token(configs["dense"], seq_len)
    return {name: round(dense_steps * dense / training_flops_per_token(c, seq_len)) for name, c in configs.items()}


def _train(name: str, model_config: dict, train_fields: dict, tokenizer_json: str) -> dict:
    # Runs in a worker process: one thread, so two runs share the two cores without oversubscribing them.
    torch.set_num_threads(1)
    from stemlm.train import TrainConfig, Trainer

    trainer = Trainer(
        ModelConfig.from_dict(model_config),
        TrainConfig(**train_fields),
        tokenizer=Tokenizer.from_str(tokenizer_json),
        progress=False,
    )
    return {"name": name, **trainer.fit()}


def train_models(cfg: KnowledgeConfig, configs, steps, tokenizer, data: Path, runs: Path) -> dict[str, dict]:
    jobs = []
    for name, config in configs.items():
        fields = dict(
            out=str(runs / name),
            data=[str(data)],
            seq_len=cfg.seq_len,
            batch_size=cfg.batch_size,
            steps=steps[name],
            lr=cfg.lr,
            seed=cfg.seed,
            eval_every=0,
            threads=1,
            device="cpu",
        )
        jobs.append((name, config.to_dict(), fields, tokenizer.to_str()))
    if cfg.parallel:
        with ProcessPoolExecutor(max_workers=len(jobs), mp_context=get_context("spawn")) as pool:
            results = list(pool.map(_train, *zip(*jobs, strict=True)))
    else:
        results = [_train(*job) for job in jobs]
    return {r["name"]: r for r in results}


# ----------------------------------------------------------------------------------------------------------
# evaluation
# ----------------------------------------------------------------------------------------------------------
@torch.no_grad()
def greedy_matches(model, pairs: list[tuple[list[int], list[int]]], batch_size: int = 128) -> list[bool]:
    """For each (prompt ids, answer ids): does greedy decoding reproduce the answer exactly? Teacher-forced
    argmax over the answer positions, which is the greedy continuation as long as every token matches."""
    out = []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        width = max(len(p) + len(a) for p, a in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        for b, (p, a) in enumerate(chunk):
            ids[b, : len(p) + len(a)] = torch.tensor(p + a)
        pred = model(ids).logits.argmax(-1)
        for b, (p, a) in enumerate(chunk):
            out.append(bool((pred[b, len(p) - 1 : len(p) - 1 + len(a)] == torch.tensor(a)).all()))
    return out


def fact_recall(model, tokenizer: Tokenizer, relations: tuple[str, ...]) -> dict:
    """Exact-match recall per template split and relation."""
    result = {}
    for split in ("train", "heldout"):
        prompts = fact_prompts(split, relations)
        pairs = [(tokenizer.encode(p.prompt).ids, tokenizer.encode(p.answer).ids) for p in prompts]
        hits = greedy_matches(model, pairs)
        result[split] = {"prompts": len(prompts), "recall": sum(hits) / len(hits)}
        for rel in relations:
            rel_hits = [h for h, p in zip(hits, prompts, strict=True) if p.relation == rel]
            result[split][rel] = sum(rel_hits) / len(rel_hits) if rel_hits else None
    return result


def _length_groups(tokenizer: Tokenizer, records, vocab: int) -> dict[str, list]:
    groups: dict[str, list] = {"equal": [], "source_longer": [], "target_longer": []}
    for r in records:
        s = len(entity_ids(tokenizer, r.subject, vocab_size=vocab))
        t = len(entity_ids(tokenizer, r.target_subject, vocab_size=vocab))
        groups["equal" if s == t else "source_longer" if s > t else "target_longer"].append(r)
    return groups


def edit_results(cfg: KnowledgeConfig, models: dict, tokenizer: Tokenizer, log) -> dict:
    records = edit_records(cfg.edit_relation, cfg.edit_records or None, seed=cfg.seed)
    stem, dense = models["stem"], models["dense"]
    caches: dict[str, dict] = {"stem": {}, "dense": {}}  # unedited scores, shared by every variant of a model
    common = dict(fluency_records=cfg.fluency_records)
    variants = {}
    for rows in ("stem", "embed", "both"):
        log(f"edits: STEM model, {rows} rows")
        variants[f"stem-{rows}"] = evaluate_edits(
            stem, tokenizer, records, rows=rows, cache=caches["stem"], details=True, **common
        )
    log("edits: dense control, embedding rows")
    variants["dense-embed"] = evaluate_edits(dense, tokenizer, records, rows="embed", cache=caches["dense"], **common)
    result = {"records": len(records), "variants": variants, "by_length": by_length(tokenizer, stem, variants)}
    if cfg.diagnostics:
        result["diagnostics"] = diagnostics(cfg, stem, tokenizer, records, caches["stem"], log)
    return result


def by_length(tokenizer: Tokenizer, stem, variants: dict) -> dict:
    """The STEM-model variants split by name lengths: single-token pairs, other equal lengths, mismatches."""
    out = {}
    for name, result in variants.items():
        details = result.pop("details", None)
        if not details:
            continue
        kinds: dict[str, list] = {}
        for row in details:
            s = len(entity_ids(tokenizer, row["subject"], vocab_size=stem.config.vocab_size))
            t = len(entity_ids(tokenizer, row["target_subject"], vocab_size=stem.config.vocab_size))
            kind = "1->1" if s == t == 1 else "equal" if s == t else "source_longer" if s > t else "target_longer"
            kinds.setdefault(kind, []).append(row)
        out.update({f"{name}:{kind}": summarize(rows) for kind, rows in sorted(kinds.items())})
    return out


def diagnostics(cfg: KnowledgeConfig, stem, tokenizer: Tokenizer, records, cache: dict, log) -> dict:
    """Where the fact lives and which strategy works: single STEM layers, global mode, mismatch strategies."""
    quick = dict(fluency_tokens=0, cache=cache)
    out: dict = {"layers": {}, "mismatch": {}}
    for layer in sorted(stem.stem_tables()):
        for rows in ("stem", "both"):
            log(f"diagnostics: layer {layer}, {rows} rows")
            out["layers"][f"layer{layer}-{rows}"] = evaluate_edits(
                stem, tokenizer, records, rows=rows, layers=[layer], **quick
            )
    log("diagnostics: global (table) edits")
    out["global-stem"] = evaluate_edits(stem, tokenizer, records, rows="stem", mode="global", **quick)
    out["global-both"] = evaluate_edits(stem, tokenizer, records, rows="both", mode="global", **quick)
    everything = edit_records(cfg.edit_relation, None, seed=cfg.seed)
    groups = _length_groups(tokenizer, everything, stem.config.vocab_size)
    out["length_groups"] = {k: len(v) for k, v in groups.items()}
    plans = {
        "source_longer": [
            ("copy", "source"),
            ("left_pad", "source"),
            ("left_pad", "eot"),
            ("left_pad", "zero"),
            ("right_pad", "source"),
        ],
        "target_longer": [("subset", "source"), ("average", "source")],
    }
    for group, settings in plans.items():
        for strategy, pad in settings:
            if not groups[group]:
                continue
            log(f"diagnostics: {group}, {strategy}/{pad}")
            out["mismatch"][f"{group}:{strategy}:{pad}"] = evaluate_edits(
                stem, tokenizer, groups[group], rows="stem", strategy=strategy, pad=pad, **quick
            )
    out["row_norms"] = row_norms(stem, tokenizer, groups["target_longer"])
    return out


@torch.no_grad()
def row_norms(stem, tokenizer: Tokenizer, records) -> dict:
    """Mean L2 norm, per STEM layer, of single target rows vs the averaged rows `average` would use."""
    out = {}
    for layer, table in stem.stem_tables().items():
        single, averaged = [], []
        for r in records:
            ids = entity_ids(tokenizer, r.target_subject, vocab_size=stem.config.vocab_size)
            rows = table.weight[ids]
            single += rows.norm(dim=-1).tolist()
            averaged.append(float(rows.mean(0).norm()))
        if single:
            out[str(layer)] = {"single_row": sum(single) / len(single), "averaged": sum(averaged) / len(averaged)}
    return out


# ----------------------------------------------------------------------------------------------------------
# the whole experiment
# ----------------------------------------------------------------------------------------------------------
def run_knowledge(cfg: KnowledgeConfig, log=print) -> dict:
    from stemlm.runs import load_checkpoint

    start = time.perf_counter()
    out = Path(cfg.out)
    if (out / "runs").exists() and any((out / "runs").iterdir()):
        raise StemlmError(f"{out}/runs already holds training runs; choose another --out or delete it")
    tokenizer, data = build_data(cfg, out / "data")
    configs = model_configs(cfg)
    steps = matched_steps(configs, cfg.seq_len, cfg.dense_steps)
    flops = {
        n: training_flops_per_token(c, cfg.seq_len) * steps[n] * cfg.seq_len * cfg.batch_size
        for n, c in configs.items()
    }
    log(f"training dense ({steps['dense']} steps) and STEM ({steps['stem']} steps) at matched FLOPs ...")
    training = train_models(cfg, configs, steps, tokenizer, data, out / "runs")
    models = {name: load_checkpoint(training[name]["checkpoint"])[0] for name in configs}
    log("fact recall ...")
    recall = {name: fact_recall(m, tokenizer, cfg.relations) for name, m in models.items()}
    edits = edit_results(cfg, models, tokenizer, log)
    single = sum(len(entity_ids(tokenizer, c.name)) == 1 for c in _countries())
    results = {
        "config": asdict(cfg),
        "steps": steps,
        "training_flops": flops,
        "training": {n: {k: v for k, v in r.items() if k != "name"} for n, r in training.items()},
        "single_token_country_names": single,
        "recall": recall,
        "edits": edits,
        "wall_s": time.perf_counter() - start,
    }
    write_report(results, out)
    log(recall_table(results))
    return results


# ----------------------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------------------
def _cell(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else "-" if value is None else str(value)


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows])


def edit_table(summaries: dict[str, dict]) -> str:
    return format_edit_table(summaries)


def recall_table(results: dict) -> str:
    rows = []
    for name, r in results["recall"].items():
        t = results["training"][name]
        rows.append(
            [
                name,
                results["steps"][name],
                f"{results['training_flops'][name]:.3g}",
                t["tokens_seen"],
                t["train_loss"],
                t["heldout_loss"],
                r["train"]["recall"],
                r["heldout"]["recall"],
                t["train_time_s"],
            ]
        )
    header = [
        "model",
        "steps",
        "train FLOPs",
        "tokens",
        "train loss",
        "held-out loss",
        "recall (train tpl)",
        "recall (held-out tpl)",
        "train s",
    ]
    return markdown_table(header, rows)


def write_report(results: dict, out: Path) -> None:
    """OUT/results.json (everything) and OUT/results.md (the tables)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    edits = results["edits"]
    parts = [
        "# Knowledge experiment: dense vs STEM at matched training FLOPs",
        "",
        f"Wall time {results['wall_s']:.0f} s; {results['single_token_country_names']} of "
        f"{len(_countries())} country names are single tokens.",
        "",
        "## Training and fact recall (exact greedy continuation)",
        "",
        recall_table(results),
        "",
        f"## Positional edits ({edits['records']} {results['config']['edit_relation']} records)",
        "",
        edit_table(edits["variants"]),
        "",
        "## The STEM model's edits by name lengths (1->1: both names single tokens)",
        "",
        edit_table(edits["by_length"]),
        "",
    ]
    diag = edits.get("diagnostics")
    if diag:
        parts += [
            "## Diagnostics: one STEM layer at a time, and global (table) edits",
            "",
            edit_table({**diag["layers"], "global-stem": diag["global-stem"], "global-both": diag["global-both"]}),
            "",
            f"## Length mismatch strategies (STEM rows; groups {diag['length_groups']})",
            "",
            edit_table(diag["mismatch"]),
            "",
            "Mean row norms of the targets' single rows vs their averaged rows, per STEM layer: "
            + "; ".join(
                f"layer {k}: {v['single_row']:.3f} vs {v['averaged']:.3f}" for k, v in diag["row_norms"].items()
            ),
            "",
        ]
    (out / "results.md").write_text("\n".join(parts))


def _countries():
    from stemlm.facts import load_countries

    return load_countries()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="dense vs STEM knowledge experiment")
    parser.add_argument("--out", default=KnowledgeConfig.out, help="output folder")
    parser.add_argument("--steps", type=int, default=KnowledgeConfig.dense_steps, help="dense training steps")
    a = parser.parse_args()
    run_knowledge(KnowledgeConfig(out=a.out, dense_steps=a.steps))
