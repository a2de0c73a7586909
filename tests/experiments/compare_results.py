"""Shared pieces of the compare tests: a run's result row as `run_kind` returns it (the report's input, with
the figures a test chooses), and a two-step compare run of one arm on a slice of the embedded corpus."""

from __future__ import annotations

import dataclasses

from stemlm.data.corpus import embedded_texts
from stemlm.data.tokenizer import default_tokenizer
from stemlm.experiments.compare import CompareConfig, model_configs, run_kind
from stemlm.experiments.compare_report import ACC_TASKS

TOK = default_tokenizer()


def result_row(kind, loss=4.0, *, acc=0.25, flops=1e15, table_lr=3e-2, niah=0.0, spikes=0) -> dict:
    """A finished run's result as the report reads it."""
    return {
        "kind": kind,
        "lr": 3e-3,
        "table_lr": table_lr,
        "embed_lr": 3e-3,
        "tokens": 384,
        "params_total": 10,
        "params_active": 5,
        "train_flops_per_token": 1.0,
        "steps": 3,
        "train_flops": flops,
        "heldout": {"loss": loss, "bits_per_byte": 1.5},
        "tasks": {t: {"acc": acc} for t in ACC_TASKS},
        "niah": {"by_length": {"64": niah}, "accuracy": niah},
        "fit": {"loss_spikes": spikes, "tokens_per_s": 1000.0},
    }


def train_two_steps(cfg: CompareConfig, arm: str, tmp_path) -> dict:
    """`run_kind` on one arm of `cfg` for two steps, no evaluation: what a compare worker returns."""
    data = tmp_path / "train.txt"
    data.write_text("\n\n".join(embedded_texts("train")[:40]))
    job = {
        "kind": arm,
        "model": model_configs(cfg, TOK)[arm].to_dict(),
        "steps": 2,
        "lr": 3e-3,
        "seed": 0,
        "evaluate": False,
        "overrides": {},
        "cfg": dataclasses.asdict(cfg),
        "digest": cfg.digest(),
        "run_dir": str(tmp_path / "run"),
        "data": str(data),
    }
    return run_kind(job, None)
