"""What a resume reads and checks before it touches a file: the run, its checkpoint, config, tokenizer and state.

`resume_setup(path, tokenizer=..., overrides=...)` finds the checkpoint (`--resume RUN` or a checkpoint folder of
a run), refuses symlinks in the run folder (`guard.check_run_links`), reads the run's training config with this
resume's overrides applied, and refuses what would not continue the same run: another recipe, another seed (the
data windows follow it), another tokenizer. `check_resume_state(ckpt, cfg)` adds the checks on the trainer state
that need no model: the run is not already at its last step, and the optimizer state to resume is there.
`check_finite_weights(model, ckpt)` refuses a checkpoint whose weights hold NaN or Inf (resuming would train
NaN on; `--allow-nonfinite` resumes anyway). The trainer (`Trainer.resume`) and the `--nproc` launcher's
preflight (`stemlm.train.preflight`) both run these, so a refusal costs nothing and is the same in both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from stemlm.checkpoint.folder import TOKENIZER_NAME
from stemlm.checkpoint.runs import CHECKPOINTS_DIR, resolve_checkpoint
from stemlm.data.tokenizer import tokenizer_digest
from stemlm.errors import StemlmError
from stemlm.train.config import TrainConfig, saved_defaults
from stemlm.train.guard import check_run_links
from stemlm.train.recipes import check_same_recipe
from stemlm.train.state import OPTIMIZER_NAME, read_resumable_state

RUN_CONFIG_NAME = "run_config.json"  # not config.json: that name marks a model checkpoint folder


@dataclass(frozen=True)
class ResumeSetup:
    ckpt: Path  # the checkpoint folder resumed from
    run_dir: Path
    cfg: TrainConfig  # the run's training config with this resume's overrides
    tokenizer: Tokenizer  # the run's own
    state: dict[str, Any]  # the checkpoint's trainer_state.json, type-checked


def resume_setup(
    path: str | Path, *, tokenizer: Tokenizer | None = None, overrides: dict[str, Any] | None = None
) -> ResumeSetup:
    """The checkpoint, config and tokenizer a resume of `path` continues with, or a one-line StemlmError."""
    overrides = overrides or {}
    ckpt = resolve_checkpoint(path)
    run_dir = ckpt.parent.parent
    if ckpt.parent.name != CHECKPOINTS_DIR or not (run_dir / RUN_CONFIG_NAME).is_file():
        raise StemlmError(f"{path} is not a training run folder (no {RUN_CONFIG_NAME}); cannot resume it")
    check_run_links(run_dir)
    try:
        saved = json.loads((run_dir / RUN_CONFIG_NAME).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StemlmError(f"{run_dir / RUN_CONFIG_NAME} is corrupt ({exc})") from None
    # The training config the checkpoint was written under (it includes earlier resumes' overrides).
    state = read_resumable_state(ckpt)
    train = state["config"]["train"]
    train.update(saved_defaults(train))  # fields the checkpoint predates: what it trained with
    check_same_recipe(train.get("recipe", "stemlm"), overrides, run_dir)
    if "seed" in overrides and "seed" in train and overrides["seed"] != train["seed"]:
        raise StemlmError(
            f"run {run_dir} was trained with --seed {train['seed']}; it cannot resume with --seed {overrides['seed']} "
            "(the data windows follow the seed): drop --seed, or start a new run from its weights with --init-from"
        )
    check_same_facts(train, overrides, run_dir)
    cfg = TrainConfig.from_dict(train).with_overrides({**overrides, "out": str(run_dir)})
    try:
        run_tok = Tokenizer.from_file(str(ckpt / TOKENIZER_NAME))
    except Exception as exc:  # tokenizers raises a bare Exception for a missing or malformed file
        raise StemlmError(f"cannot read the run's tokenizer {ckpt / TOKENIZER_NAME}: {exc}") from None
    if tokenizer is not None and tokenizer_digest(tokenizer) != tokenizer_digest(run_tok):
        name = saved.get("tokenizer", {}).get("name") if isinstance(saved, dict) else None
        raise StemlmError(
            f"tokenizer differs from the run's: run {name!r} "
            f"({run_tok.get_vocab_size()} tokens, sha {tokenizer_digest(run_tok)}), requested "
            f"{tokenizer.get_vocab_size()} tokens, sha {tokenizer_digest(tokenizer)}"
        )
    return ResumeSetup(ckpt, run_dir, cfg, run_tok, state)


def check_same_facts(train: dict[str, Any], overrides: dict[str, Any], run_dir: Path) -> None:
    """Refuse a resume that changes the run's fact mix (`fact_*`): its statements are part of the training data the
    run's windows are drawn from, so the resumed run would not continue the same one."""
    changed = sorted(k for k, v in overrides.items() if k.startswith("fact_") and v != train.get(k))
    if changed and train.get("data") is not None:
        raise StemlmError(
            f"--set train.{changed[0]} has no effect on run {run_dir}: it trains on --data, and the fact world is "
            "mixed into the embedded corpus only; drop the setting"
        )
    if changed:
        name = changed[0]
        raise StemlmError(
            f"run {run_dir} was trained with {name}={train.get(name)!r}; it cannot resume with {name}="
            f"{overrides[name]!r} (the fact statements are part of its training data): drop the setting, or start a "
            "new run from its weights with --init-from"
        )


def check_resume_state(ckpt: Path, state: dict[str, Any], cfg: TrainConfig) -> None:
    """Refuse a resume of a run already at its last step, or of a checkpoint without its optimizer state."""
    step = state["step"]
    if step >= cfg.steps:
        raise StemlmError(
            f"run {ckpt.parent.parent} is already at step {step} of {cfg.steps}; pass a larger --steps to continue"
        )
    if "distributed" not in state and not (ckpt / OPTIMIZER_NAME).exists():
        raise StemlmError(
            f"{ckpt} holds no optimizer state to resume from: only a run's newest checkpoint keeps it (train with "
            f"--set train.keep_optimizer_state=all to keep it in every one); resume from the newest checkpoint, "
            f"or start from these weights with --init-from {ckpt}"
        )


@torch.no_grad()
def check_finite_weights(model: torch.nn.Module, ckpt: Path) -> None:
    """Refuse weights holding NaN or Inf, naming the first such tensor (each rank checks its own shard)."""
    for name, tensor in model.state_dict().items():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's part
        if local.is_floating_point() and local.device.type != "meta" and not torch.isfinite(local).all():
            raise StemlmError(
                f"checkpoint {ckpt}: tensor {name} holds NaN or Inf; resuming would train on them (resume an earlier "
                "checkpoint, or pass --allow-nonfinite to resume anyway)"
            )
