"""Training recipes: the rules of the update around the model (init, optimizer groups, clipping, schedule).

    stemlm train --recipe official --out runs/official     # the official STEM code's rules
    stemlm train --out runs/default                         # --recipe stemlm, the default

`TrainConfig.recipe` names the recipe; the trainer builds it with `get_recipe(name)` and asks it for four things:
`init_weights(model, seed)` after the model is built, `build_optimizers(model, cfg)`, `set_learning_rates(
optimizers, step, cfg)` before every update and `clip_gradients(optimizers, max_norm)` after the backward. The
model's own init (`StemLM.init_weights`) is never changed: a recipe re-initialises from outside.

- `stemlm` (`StemlmRecipe`): `stemlm.train.optim` unchanged (norm gains undecayed, one global clip, warm-up factor
  (step+1)/warmup, the model's N(0, initializer_range) init).
- `official` (`OfficialRecipe`), read from Infini-AI-Lab/STEM `main` (`apps/main/stem_train.py`, `lingua/optim.py`,
  `lingua/transformer.py`, `lingua/stem.py`, `apps/main/stem.py`):
  - init: truncated normal cut at ±3σ. σ = init_base_std (here the model's `initializer_range`, 0.02 as in the
    later official configs) for q/k/v/o, gate, up and down projections: the official `reset_parameters` take
    `init_std or dim**-0.5` for the in-projections and `init_std or hidden_dim**-0.5` for `w2`, so with
    init_base_std set `w2` gets it too (d_ff^-½ only when it is unset); the std factor is the default
    `disabled` (1). Token embedding and an untied output head: σ = d^-½ always (`LMTransformer.reset_parameters`
    is called without a std). Norm gains ones; the tables keep the model's init (xavier-normal, the official one).
  - optimizers: one AdamW over every backbone parameter, norm gains included, at `lr` / `weight_decay`; a dense
    AdamW over the tables at the table lr and weight decay (`train_config` gives them the backbone's settings
    unless `table_lr` / `table_wd` are set, as the later configs' table options do).
  - clipping: each optimizer's gradients by their own L2 norm (torch's `clip_grad_norm_`), each to `grad_clip`
    (0: off, as in stemlm; the official code has no off switch).
  - schedule: `lingua/optim.py:lr_cosine` with one cycle and θ 1: step/warmup during warm-up (the first update at
    lr 0), then min + (1 - min)(1 + cos(π s))/2 with s = (step - warmup) / (steps - warmup).
  It trains a model only when an official rule covers every parameter (`uncovered_parameters`): the embedding and
  head, the attention and gate/up/down projections, norm gains and `token` tables of the model's default table
  init. That admits the official code's two kinds, dense and stem, and stem_gate (a STEM table in the gate's
  place: the same kinds of parameter); every other kind has parameters the official code has no init or optimizer
  rule for (routers and expert banks, mixing scalars, n-gram and memory tables, their projections) and is refused,
  naming them. On one process or several (`--nproc`: each rank draws every official init value and keeps its
  FSDP2 rows, the tables keep their sharded default init; the backbone and the table shards are clipped apart,
  `clip_distributed`).
Tests: tests/train/test_recipes.py (each rule against a plain re-computation, the kinds it covers, and two steps
against a plain-torch official update), tests/train/test_recipes_bad_input.py (the CLI refusal of a kind),
tests/train/parallel/test_recipe_dist.py (2 ranks against 1 process).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from stemlm.errors import StemlmError
from stemlm.model.decoder import StemLM
from stemlm.placement.table_optim import clip_grad_norm_mixed, fast_optimizer_impl, make_table_optimizer
from stemlm.train import optim
from stemlm.train.config import TrainConfig

TRUNCATION = 3.0  # the official trunc_normal_ bounds: ±3σ
STD_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def train_config(changes: dict[str, Any]) -> TrainConfig:
    """The `TrainConfig` of a fresh run from command-line `changes`, with the recipe's defaults under them.

    Under `recipe=official` the tables default to the official settings: dense AdamW at the backbone's lr (x1)
    and weight decay (`--weight-decay` included), unless `table_lr` / `table_lr_scale` / `table_wd` are given."""
    if changes.get("recipe") != "official":
        return TrainConfig().with_overrides(changes)
    defaults = {
        "table_optim": "adamw",
        "table_lr_scale": 1.0,
        "table_wd": changes.get("weight_decay", TrainConfig.weight_decay),
    }
    return TrainConfig().with_overrides({**defaults, **changes})


def check_same_recipe(run_recipe: str, overrides: dict[str, Any], run_dir: Any) -> None:
    """A resumed run keeps the recipe it was started with."""
    requested = overrides.get("recipe", run_recipe)
    if requested != run_recipe:
        raise StemlmError(
            f"run {run_dir} was trained with --recipe {run_recipe}; it cannot resume as --recipe {requested}"
        )


class StemlmRecipe:
    """The default: `stemlm.train.optim` as it is (its docstring and `train/config.py` give the reasons)."""

    name = "stemlm"

    def init_weights(self, model: StemLM, seed: int) -> None:
        """Nothing to do: `build_model` already drew the stemlm init."""

    def build_optimizers(self, model: StemLM, cfg: TrainConfig) -> list[torch.optim.Optimizer]:
        return optim.build_optimizers(model, cfg)

    def lr_multiplier(self, step: int, cfg: TrainConfig) -> float:
        return optim.lr_multiplier(step, cfg)

    def set_learning_rates(self, optimizers: list[torch.optim.Optimizer], step: int, cfg: TrainConfig) -> float:
        return optim.set_learning_rates(optimizers, step, cfg)

    def clip_gradients(self, optimizers: list[torch.optim.Optimizer], max_norm: float) -> torch.Tensor:
        return optim.clip_gradients(optimizers, max_norm)

    def clip_distributed(
        self, backbone: list[torch.Tensor], shards: list[torch.Tensor], max_norm: float
    ) -> torch.Tensor:
        """`--nproc`: one clip over the backbone (replicated or FSDP2-sharded) and the table row shards together."""
        return clip_grad_norm_mixed(backbone, max_norm if max_norm > 0 else math.inf, sharded_params=shards)


class OfficialRecipe(StemlmRecipe):
    """The official STEM code's update rules (see the module docstring for each rule and its source)."""

    name = "official"

    def init_weights(self, model: StemLM, seed: int) -> None:
        check_official_kinds(model)
        generator = torch.Generator(device="cpu")
        generator.manual_seed(seed)
        with torch.no_grad():
            for _, param, std in official_init_specs(model):
                # Drawn on the CPU from one generator, as StemLM.init_weights does, so a seed gives one model anywhere
                # (and every rank of a multi-process run the same values).
                values = torch.empty(param.shape, dtype=torch.float32)
                torch.nn.init.trunc_normal_(values, 0.0, std, -TRUNCATION * std, TRUNCATION * std, generator=generator)
                _copy_whole(param, values)

    def build_optimizers(self, model: StemLM, cfg: TrainConfig) -> list[torch.optim.Optimizer]:
        check_official_kinds(model)
        parts = optim.split_parameters(model)
        backbone = parts["decay"] + parts["no_decay"]
        groups = [{"params": backbone, "weight_decay": cfg.weight_decay, "name": "backbone", "peak_lr": cfg.lr}]
        if cfg.embed_like_tables:  # the dense control: the token embedding at the tables' lr and wd
            embed = model.model.embed_tokens.weight
            groups[0]["params"] = [p for p in backbone if p is not embed]
            groups.append(
                {"params": [embed], "weight_decay": cfg.table_wd, "name": "embed", "peak_lr": cfg.table_peak_lr}
            )
        groups = [g for g in groups if g["params"]]
        betas = (cfg.beta1, cfg.beta2)
        optimizers: list[torch.optim.Optimizer] = []
        if groups:
            impl = fast_optimizer_impl(p for g in groups for p in g["params"])
            optimizers.append(torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, **impl))
        if parts["tables"]:
            tables = make_table_optimizer(
                "adamw", parts["tables"], lr=cfg.table_peak_lr, betas=betas, eps=cfg.eps, weight_decay=cfg.table_wd
            )
            for group in tables.param_groups:
                group.update(name="tables", peak_lr=cfg.table_peak_lr)
            optimizers.append(tables)
        return optimizers

    def lr_multiplier(self, step: int, cfg: TrainConfig) -> float:
        return official_lr_multiplier(step, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio)

    def set_learning_rates(self, optimizers: list[torch.optim.Optimizer], step: int, cfg: TrainConfig) -> float:
        mult = self.lr_multiplier(step, cfg)
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = group["peak_lr"] * mult
        return mult

    def clip_gradients(self, optimizers: list[torch.optim.Optimizer], max_norm: float) -> torch.Tensor:
        """Clip each optimizer's gradients by their own norm; returns the global norm before clipping (logged).

        torch's `clip_grad_norm_`, as the official code calls it: every gradient is dense under this recipe, and its
        norm is taken in the gradients' dtype (the library's mixed clip sums squares in float32)."""
        limit = max_norm if max_norm > 0 else math.inf
        norms = []
        for opt in optimizers:
            params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
            if params:
                norms.append(torch.nn.utils.clip_grad_norm_(params, limit))
        return _global_norm(norms)

    def clip_distributed(
        self, backbone: list[torch.Tensor], shards: list[torch.Tensor], max_norm: float
    ) -> torch.Tensor:
        """`--nproc`: the backbone and the table row shards each by their own norm (summed over the ranks)."""
        limit = max_norm if max_norm > 0 else math.inf
        norms = [clip_grad_norm_mixed(backbone, limit)] if backbone else []
        norms += [clip_grad_norm_mixed([], limit, sharded_params=shards)] if shards else []
        return _global_norm(norms)


def _global_norm(norms: list[torch.Tensor]) -> torch.Tensor:
    """The norm of all gradients from each group's norm (what the trainer logs as grad_norm)."""
    if not norms:
        return torch.zeros(())
    return torch.stack([n.to(norms[0].device) for n in norms]).square().sum().sqrt()


def _copy_whole(param: torch.Tensor, values: torch.Tensor) -> None:
    """`param` = `values`; an FSDP2 parameter (a DTensor) keeps this rank's rows of them (no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    values = values.to(param.device, param.dtype)
    if isinstance(param, DTensor):
        values = distribute_tensor(values, param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(values)


def official_lr_multiplier(step: int, warmup: int, steps: int, min_ratio: float) -> float:
    """`lingua/optim.py:lr_cosine` (cycle_length 1, theta 1) for the update at 0-based `step` (< steps)."""
    if step < warmup:
        return step / warmup
    progress = (step - warmup) / (steps - warmup)
    return min_ratio + 0.5 * (1 - min_ratio) * (math.cos(math.pi * progress) + 1)


def official_init_specs(model: StemLM) -> list[tuple[str, torch.nn.Parameter, float]]:
    """(name, parameter, σ) of every parameter the official init draws, in `named_parameters` order."""
    config, specs = model.config, []
    for name, param in model.named_parameters():  # a tied lm_head is the embedding: listed once
        module = name.rsplit(".", 2)[-2]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            specs.append((name, param, config.hidden_size**-0.5))
        elif module in STD_PROJECTIONS:
            specs.append((name, param, config.initializer_range))
    return specs


def uncovered_parameters(model: StemLM) -> list[str]:
    """Parameter names (within their layer) of `model` that no official rule covers, in `named_parameters` order."""
    own = model.init_stds()  # a kind's own init (zero n-gram rows, memory keys) is no official rule
    token_tables = {id(t.weight) for t in model.tables("token").values()}
    covered = {id(p) for _, p, _ in official_init_specs(model)} | (token_tables - set(own))
    uncovered = []
    for name, param in model.named_parameters():
        if id(param) not in covered and not name.endswith("norm.weight"):
            short = name.split(".mlp.")[-1].split(".self_attn.")[-1]
            if short not in uncovered:
                uncovered.append(short)
    return uncovered


def check_official_kinds(model: StemLM) -> None:
    uncovered = uncovered_parameters(model)
    if uncovered:
        raise StemlmError(
            f"--recipe official has no init or optimizer rule for {model.config.ffn}'s {', '.join(uncovered)} (the "
            "official code's rules cover the embedding and head, the attention and gate/up/down projections, norm "
            "gains and token tables): use --recipe stemlm"
        )


_RECIPES = {"stemlm": StemlmRecipe, "official": OfficialRecipe}


def get_recipe(name: str) -> StemlmRecipe:
    if name not in _RECIPES:
        raise StemlmError(f"unknown recipe {name!r}; choose one of {', '.join(_RECIPES)}")
    return _RECIPES[name]()


__all__ = ["OfficialRecipe", "StemlmRecipe", "get_recipe", "official_lr_multiplier", "train_config"]
