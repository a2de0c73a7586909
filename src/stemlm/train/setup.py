"""A training run from what a command asked for: the model config it trains, and a fresh, resumed or initialised
trainer.

`RunRequest` holds the model choices (a preset, the FFN kind and its layers, `model.<field>=V` overrides,
`--fit-vocab`), the typed `TrainConfig` changes, the tokenizer, and where the weights come from (`resume` a run,
`init_from` a checkpoint, or fresh); `build_trainer(request)` resolves it: a resumed run keeps its vocabulary,
an initialised one its checkpoint's config, and a fresh one's vocabulary is checked against the tokenizer
(`stemlm.train.config.check_vocab`: the tiny default follows it, a named preset is never resized silently);
`run_training(request, ...)` trains it and returns the final report.
`stemlm train` builds the request from its flags (`RunRequest.from_args`; the flags: stemlm.cli.train).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from stemlm.errors import StemlmError
from stemlm.flags import given_fields, setting
from stemlm.model.config import FFN_KINDS, ModelConfig
from stemlm.model.presets import get_preset


@dataclass
class RunRequest:
    """What `stemlm train` asks for beyond the `TrainConfig` fields: the flags of the model choices and of resuming
    are declared here (`stemlm.flags`), those of `preset`, `tokenizer` and `init_from` on `TrainConfig`."""

    changes: dict[str, Any] = field(default_factory=dict)  # TrainConfig fields given, typed
    preset: str | None = None  # a named model preset (also names the run folder)
    ffn: str | None = setting(
        None, "FFN kind of the selected layers (default: the preset's)", section="model", one_of=FFN_KINDS
    )
    ffn_layers: str | None = setting(  # a layer spec
        None,
        "layers with the --ffn kind: all, all-but-first, odd, every:K, 1,3,...",
        section="model",
        metavar="SPEC",
        aliases=("--stem-layers",),
    )
    model_sets: list[str] = field(default_factory=list)  # "model.<field>=V" overrides
    fit_vocab: bool = setting(
        False,
        "resize the model's vocab_size to the tokenizer (rounded up to 64); without it a --preset or "
        "model.vocab_size that does not fit the tokenizer is an error (without --preset the tiny default fits)",
        section="model",
        const=True,
    )
    tokenizer: str | None = None  # default | gpt2 | a path; None: the run's, the checkpoint's or the default
    resume: str | None = setting(  # this run (or this checkpoint of a run)
        None,
        "continue this run from its newest checkpoint (or from the given checkpoint folder of a run)",
        section="checkpointing",
        metavar="RUN_DIR",
    )
    init_from: str | None = None  # start from this model checkpoint's weights
    progress: bool = True  # the progress bar
    allow_nonfinite: bool = setting(
        False,
        "with --resume: continue even when the checkpoint's weights hold NaN or Inf (refused by default)",
        section="checkpointing",
        const=True,
    )

    @classmethod
    def from_args(cls, args) -> RunRequest:
        """The request of a parsed `stemlm train` command line: its flags of this class's and `TrainConfig`'s
        settings (a `TrainConfig` flag wins over `--set train.<field>=V`), `--set model.<field>=V`, `--table-lr`
        (a number, or xN of --lr) and `--no-progress`."""
        from stemlm.model.overrides import split_sections, typed_overrides
        from stemlm.train.config import TrainConfig, table_lr_fields

        sets = split_sections(args.overrides, ("model", "train"))
        changes = typed_overrides(TrainConfig, sets["train"], prefix="train.", label="training config key")
        given = given_fields(args, TrainConfig)
        table_lr = given.pop("table_lr", None)  # a number or xN: table_lr or table_lr_scale
        changes.update(given)
        if table_lr is not None:
            changes.update(table_lr_fields(table_lr))
        return cls(changes, model_sets=sets["model"], progress=not args.no_progress, **given_fields(args, cls))


def requested_model(r: RunRequest, base: ModelConfig | None) -> tuple[ModelConfig | None, bool]:
    """The model config the request asks for (None if it names no model choice) and whether vocab_size was set."""
    if not (r.preset or r.ffn or r.ffn_layers or r.model_sets):
        return None, False
    config = get_preset(r.preset) if r.preset else (base or get_preset("tiny"))
    flags = [f"ffn={r.ffn}"] * bool(r.ffn) + [f"ffn_layers={r.ffn_layers}"] * bool(r.ffn_layers)
    config = config.with_overrides(flags + r.model_sets)  # one change, validated once: the final config counts
    return config, any(item.split("=", 1)[0] == "model.vocab_size" for item in r.model_sets)


@dataclass
class RunPlan:
    """What `build_trainer` builds, resolved without building anything (`plan_run`)."""

    model: ModelConfig | None  # the model config asked for; None: the checkpoint's (a resume or --init-from)
    tokenizer: Any  # the tokenizer asked for (a resume: to compare with the run's); None: the run's or default
    cfg: Any = None  # the TrainConfig of a fresh or initialised run
    changes: dict[str, Any] = field(default_factory=dict)  # a resume's training overrides


def plan_run(r: RunRequest) -> RunPlan:
    """Resolve the request: the model config, the tokenizer, and the training config (a resume: its overrides)."""
    from stemlm.checkpoint.folder import load_config
    from stemlm.checkpoint.runs import resolve_checkpoint
    from stemlm.data import get_tokenizer
    from stemlm.train.config import check_vocab
    from stemlm.train.data import resolve_tokenizer
    from stemlm.train.recipes import train_config

    changes = dict(r.changes)
    tokenizer = get_tokenizer(r.tokenizer) if r.tokenizer else None
    if r.resume:
        if r.init_from:
            raise StemlmError("--resume and --init-from cannot be combined: a resumed run has its own weights")
        run_config = load_config(resolve_checkpoint(r.resume))
        model, vocab_set = requested_model(r, run_config)
        if model is not None and not vocab_set:
            model = model.replace(vocab_size=run_config.vocab_size)  # vocab follows the tokenizer, checked apart
        changes.pop("tokenizer", None)
        return RunPlan(model, tokenizer, changes=changes)
    if r.init_from:
        changes.setdefault("preset", os.path.basename(os.path.normpath(r.init_from)))
        model, _ = requested_model(r, load_config(r.init_from))
        return RunPlan(model, tokenizer, check_fact_flags(train_config(changes), changes))
    cfg = check_fact_flags(train_config(changes), changes)
    model, vocab_set = requested_model(r, None)
    if model is None:
        model = get_preset(cfg.preset)
    tokenizer = tokenizer or resolve_tokenizer(cfg)  # default, or a prepared --data folder's own
    # The tiny default follows the tokenizer; a named preset or an explicit vocab_size is never resized silently.
    explicit = bool(r.preset) or vocab_set
    requested = f"preset {r.preset}" if r.preset else "model.vocab_size"
    model = check_vocab(model, tokenizer, requested=requested, vocab_set=vocab_set, fit=r.fit_vocab or not explicit)
    return RunPlan(model, tokenizer, cfg)


def check_fact_flags(cfg, changes: dict[str, Any]):
    """`cfg`, unless it names --data together with a fact-world setting: the fact world is mixed into the embedded
    corpus only (stemlm.data.fact_mix), so with --data the setting would silently do nothing."""
    given = sorted(k for k in changes if k.startswith("fact_"))
    if cfg.data is not None and given:
        raise StemlmError(
            f"--set train.{given[0]} has no effect with --data: the fact world is mixed into the embedded corpus "
            "only; drop the setting, or --data to train on the embedded corpus with facts"
        )
    return cfg


def build_trainer(r: RunRequest):
    """A fresh, resumed or initialised trainer (in a torchrun worker, one rank of the job: `stemlm.train.world`)."""
    from stemlm.train.trainer import Trainer

    plan = plan_run(r)
    if r.resume:
        return Trainer.resume(
            r.resume,
            model_config=plan.model,
            tokenizer=plan.tokenizer,
            overrides=plan.changes,
            progress=r.progress,
            allow_nonfinite=r.allow_nonfinite,
        )
    return Trainer(plan.model, plan.cfg, tokenizer=plan.tokenizer, progress=r.progress)


def run_training(r: RunRequest, sample_prompt: str, sample_tokens: int) -> dict[str, Any] | None:
    """Build the trainer, train on all cores (a torchrun rank: its share), and return the final report
    (`stemlm.train.report.final_report`); None on the ranks other than 0 of a distributed run."""
    import torch

    from stemlm.train.parallel.workers import default_threads, distributed_worker
    from stemlm.train.report import final_report

    threads = torch.get_num_threads()
    try:
        trainer = build_trainer(r)
        torch.set_num_threads(trainer.cfg.threads or default_threads())
        result = trainer.fit()
        if distributed_worker():
            # Leave the process group; rank 0 reloads the final, unsharded model when the report uses it (a sample,
            # the recall of mixed-in facts): the trained one's tables are sharded over the ranks that just left.
            sampled = sample_tokens > 0 and not result.get("stopped_by")
            facts = trainer.cfg.data is None and trainer.cfg.fact_fraction > 0
            trainer.finish(result["checkpoint"] if sampled or facts else None)
            if not trainer.world.is_main:
                return None
        return final_report(trainer, result, sample_prompt, sample_tokens)
    finally:
        torch.set_num_threads(threads)  # in-process callers (tests) keep their own setting
