"""Optimizer construction: parameter groups, one optimizer per group family, and the learning-rate schedule.

`build_optimizers(model, cfg)` returns a list of torch optimizers, backbone first:

- backbone AdamW with two groups: `decay` (every parameter with two or more dimensions: projections, token
  embedding, LM head, router, stacked experts; the official code decays these too) and `no_decay` (norm gains
  and any bias, i.e. one-dimensional parameters, which the official code decays: `--recipe official`);
- the table optimizer (only when the model has lookup tables): every table of `model.lookup_tables()` (token, n-gram
  and memory families alike, stemlm.model.kinds.registry) in one group with its own peak lr and weight decay, built by
  `stemlm.placement.table_optim.make_table_optimizer` under the name `cfg.table_optim` (`adamw`: dense, the official
  behaviour; the row-sparse ones switch the tables to sparse gradients here);
- with `cfg.embed_like_tables`, the token embedding leaves `decay` for its own backbone group `embed` at the
  tables' peak lr and weight decay: the control that tells "STEM helps" from "a per-token table at lr x10
  helps" (a dense model whose only per-token table gets the same treatment).

The backbone AdamW and the dense table AdamW take torch's multi-tensor implementation by the parameters' device
(`fast_optimizer_impl`: `fused` on CUDA, `foreach` elsewhere; on CPU foreach equals the single-tensor AdamW
bitwise, tests/train/test_optim.py). Every group carries `peak_lr`; `set_learning_rates(optimizers, step, cfg)`
sets `lr = peak_lr * lr_multiplier` so the schedule is a pure function of the step (nothing to checkpoint).
`clip_gradients` computes the one global gradient norm over all parameters (dense and sparse; with
`torch._foreach_norm` on CUDA) and clips by it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from stemlm.errors import StemlmError
from stemlm.model.decoder import StemLM, layer_modules
from stemlm.placement.table_optim import (
    clip_grad_norm_mixed,
    fast_optimizer_impl,
    make_table_optimizer,
    use_sparse_table_grads,
)
from stemlm.train.config import TrainConfig


def split_parameters(model: StemLM) -> dict[str, list[nn.Parameter]]:
    """Parameters by group name: `decay`, `no_decay`, `tables` (each parameter exactly once, tied ones once)."""
    table_ids = {id(t.weight) for tables in model.lookup_tables().values() for t in tables.values()}
    groups: dict[str, list[nn.Parameter]] = {"decay": [], "no_decay": [], "tables": []}
    for param in model.parameters():  # parameters() yields a tied weight once
        if not param.requires_grad:
            continue
        if id(param) in table_ids:
            groups["tables"].append(param)
        elif param.dim() >= 2:
            groups["decay"].append(param)
        else:
            groups["no_decay"].append(param)
    return groups


def freeze_backbone(model: StemLM) -> None:
    """`--train tables`: every parameter but the lookup tables (and what their kinds train with them, such as the
    adapter's gate logits: `Kind.trains_with_tables`) stops learning."""
    keep = {id(p) for p in split_parameters(model)["tables"]}
    for i, layer in enumerate(model.model.layers):
        for kind, _, module in layer_modules(model.config, layer, i):  # the layer's FFN and side modules
            for name in kind.trains_with_tables:
                part = getattr(module, name, None)  # a parameter or a submodule; absent in a variant without it
                keep |= {id(p) for p in part.parameters()} if isinstance(part, nn.Module) else {id(part)} - {id(None)}
    if not keep:
        raise StemlmError("--train tables needs a model with token tables (e.g. one from `stemlm convert`)")
    for param in model.parameters():
        if id(param) not in keep:
            param.requires_grad_(False)


def build_optimizers(model: StemLM, cfg: TrainConfig) -> list[torch.optim.Optimizer]:
    """[backbone AdamW] or [backbone AdamW, table optimizer]; every group has `name` and `peak_lr`."""
    parts = split_parameters(model)
    betas = (cfg.beta1, cfg.beta2)
    backbone_groups = [
        {"params": parts["decay"], "weight_decay": cfg.weight_decay, "name": "decay", "peak_lr": cfg.lr},
        {"params": parts["no_decay"], "weight_decay": 0.0, "name": "no_decay", "peak_lr": cfg.lr},
    ]
    if cfg.embed_like_tables:
        embed = model.model.embed_tokens.weight
        backbone_groups[0]["params"] = [p for p in parts["decay"] if p is not embed]
        backbone_groups.append(
            {"params": [embed], "weight_decay": cfg.table_wd, "name": "embed", "peak_lr": cfg.table_peak_lr}
        )
    backbone_groups = [g for g in backbone_groups if g["params"]]
    optimizers: list[torch.optim.Optimizer] = []
    if backbone_groups:
        impl = fast_optimizer_impl(p for g in backbone_groups for p in g["params"])
        optimizers.append(torch.optim.AdamW(backbone_groups, lr=cfg.lr, betas=betas, eps=cfg.eps, **impl))
    if parts["tables"]:
        if cfg.table_optim != "adamw":
            use_sparse_table_grads(model)
        table_opt = make_table_optimizer(
            cfg.table_optim,
            parts["tables"],
            lr=cfg.table_peak_lr,
            betas=betas,
            eps=cfg.eps,
            weight_decay=cfg.table_wd,
        )
        for group in table_opt.param_groups:
            group.update(name="tables", peak_lr=cfg.table_peak_lr)
        optimizers.append(table_opt)
    return optimizers


def lr_multiplier(step: int, cfg: TrainConfig) -> float:
    """Schedule factor for the update at 0-based `step`: linear warm-up over `warmup_steps` updates reaching 1
    at the last warm-up update, then half a cosine from 1 down to `min_lr_ratio` at the final step."""
    warmup, total, floor = cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio
    if step < warmup:
        return (step + 1) / warmup
    decay_steps = total - warmup - 1
    if decay_steps <= 0:
        return 1.0
    progress = min(1.0, (step - warmup) / decay_steps)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_learning_rates(optimizers: list[torch.optim.Optimizer], step: int, cfg: TrainConfig) -> float:
    """Set every group's lr for the update at `step`; returns the multiplier."""
    mult = lr_multiplier(step, cfg)
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["peak_lr"] * mult
    return mult


def clip_gradients(optimizers: list[torch.optim.Optimizer], max_norm: float) -> torch.Tensor:
    """Clip all gradients by their one global L2 norm (0: no clipping); returns the norm before clipping."""
    params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    return clip_grad_norm_mixed(params, max_norm if max_norm > 0 else math.inf)
