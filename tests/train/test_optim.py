"""Parameter groups, per-group weight decay, the warm-up + cosine schedule and the one global gradient clip.

Each check is against arithmetic done here by hand (decay factors, cosine values, a norm over all gradients).
Run: `OMP_NUM_THREADS=1 python -m pytest tests/train/test_optim.py -q`.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from stemlm.model import build_model
from stemlm.placement.table_optim import LazyAdamW
from stemlm.train.config import TrainConfig
from stemlm.train.optim import build_optimizers, clip_gradients, lr_multiplier, set_learning_rates, split_parameters


def test_groups_cover_every_parameter_once(make_model_config):
    model = build_model(make_model_config("stem", tie_word_embeddings=True))
    parts = split_parameters(model)
    ids = [id(p) for group in parts.values() for p in group]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert {id(p) for p in parts["tables"]} == {id(t.weight) for t in model.token_tables().values()}
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(names[id(p)].endswith("norm.weight") for p in parts["no_decay"])
    assert sum(n.endswith("norm.weight") for n in names.values()) == len(parts["no_decay"])
    assert id(model.model.embed_tokens.weight) in {id(p) for p in parts["decay"]}


def test_dense_model_has_one_optimizer(make_model_config):
    opts = build_optimizers(build_model(make_model_config("dense")), TrainConfig())
    assert len(opts) == 1 and [g["name"] for g in opts[0].param_groups] == ["decay", "no_decay"]


def test_weight_decay_per_group(make_model_config):
    # With zero gradients AdamW's update is the decoupled decay alone: w <- w * (1 - lr * wd).
    model = build_model(make_model_config("stem"))
    cfg = TrainConfig(lr=0.1, weight_decay=0.5, table_lr=0.2, table_wd=0.25, table_optim="adamw")  # dense tables
    opts = build_optimizers(model, cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for opt in opts:
        opt.step()
    tables = {f"model.layers.{i}.mlp.stem_embedding.weight" for i in model.token_tables()}
    assert tables
    for name, p in model.named_parameters():
        factor = 1 - 0.2 * 0.25 if name in tables else 1.0 if name.endswith("norm.weight") else 1 - 0.1 * 0.5
        torch.testing.assert_close(p.detach(), before[name] * factor, rtol=1e-6, atol=0)


def test_embed_like_tables_gives_the_embedding_the_table_lr_and_wd(make_model_config):
    # The dense control of STEM's lr x10 tables: only the token embedding moves to the tables' lr and wd.
    model = build_model(make_model_config("dense"))
    cfg = TrainConfig(lr=0.1, weight_decay=0.5, table_lr_scale=3.0, table_wd=0.25, embed_like_tables=True)
    (opt,) = build_optimizers(model, cfg)
    groups = {g["name"]: g for g in opt.param_groups}
    assert groups["embed"]["params"] == [model.model.embed_tokens.weight]
    assert all(p is not model.model.embed_tokens.weight for p in groups["decay"]["params"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    set_learning_rates([opt], cfg.warmup_steps, cfg)  # first post-warm-up step: multiplier 1
    opt.step()
    for name, p in model.named_parameters():
        factor = (
            1 - 0.3 * 0.25
            if name == "model.embed_tokens.weight"
            else 1.0
            if name.endswith("norm.weight")
            else 1 - 0.1 * 0.5
        )
        torch.testing.assert_close(p.detach(), before[name] * factor, rtol=1e-6, atol=0)


def test_schedule_values():
    cfg = TrainConfig(steps=100, warmup=10, min_lr_ratio=0.1)
    assert lr_multiplier(0, cfg) == pytest.approx(0.1)
    assert lr_multiplier(4, cfg) == pytest.approx(0.5)
    assert lr_multiplier(9, cfg) == lr_multiplier(10, cfg) == pytest.approx(1.0)
    assert lr_multiplier(99, cfg) == pytest.approx(0.1)
    flat = TrainConfig(steps=21, warmup=0, min_lr_ratio=0.1)
    assert lr_multiplier(10, flat) == pytest.approx(0.55)  # halfway: cos = 0
    assert lr_multiplier(5, flat) == pytest.approx(0.1 + 0.45 * (1 + math.sqrt(0.5)))
    values = [lr_multiplier(s, cfg) for s in range(10, 100)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_set_learning_rates_scales_each_group_peak(make_model_config):
    model = build_model(make_model_config("stem"))
    cfg = TrainConfig(steps=100, warmup=10, lr=1e-3, table_lr_scale=10.0)
    opts = build_optimizers(model, cfg)
    mult = set_learning_rates(opts, 4, cfg)
    assert mult == pytest.approx(0.5)
    assert [g["lr"] for g in opts[0].param_groups] == pytest.approx([5e-4, 5e-4])
    assert opts[1].param_groups[0]["lr"] == pytest.approx(5e-3)


def test_one_global_clip_over_backbone_and_tables(make_model_config):
    model = build_model(make_model_config("stem"))
    opts = build_optimizers(model, TrainConfig())
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * (5.0 if p.dim() == 2 and p.shape[0] == 320 else 1.0)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    expected = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
    norm = clip_gradients(opts, max_norm=expected / 4)
    assert float(norm) == pytest.approx(expected, rel=1e-5)
    for name, p in model.named_parameters():  # every gradient, table or not, scaled by the same factor
        torch.testing.assert_close(p.grad, grads[name] / 4, rtol=1e-5, atol=1e-7)


def test_no_clip_when_disabled(make_model_config):
    model = build_model(make_model_config("dense"))
    opts = build_optimizers(model, TrainConfig())
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    clip_gradients(opts, max_norm=0.0)
    assert all(bool((p.grad == 3.0).all()) for p in model.parameters())


def test_row_sparse_table_optimizer_plugs_in(make_model_config):
    model = build_model(make_model_config("stem"))
    opts = build_optimizers(model, TrainConfig(table_optim="lazy_adamw"))
    assert isinstance(opts[1], LazyAdamW)
    assert all(t.sparse for t in model.token_tables().values())


def test_backbone_adamw_is_foreach_on_cpu_and_equals_the_single_tensor_adamw_bitwise(make_model_config):
    # Today's CPU numbers are kept: the foreach AdamW the CPU default picks (fused on CUDA) equals the single-tensor
    # one bit for bit over steps with weight decay and a changing lr.
    runs = []
    for foreach in (None, False):
        model = build_model(make_model_config("dense"), seed=0)
        opt = build_optimizers(model, TrainConfig())[0]
        if foreach is False:
            for group in opt.param_groups:
                group["foreach"] = False
        else:
            assert all(g["foreach"] is True and not g["fused"] for g in opt.param_groups)
        gen = torch.Generator().manual_seed(1)
        for step in range(4):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            for group in opt.param_groups:
                group["lr"] = group["peak_lr"] * (step + 1) / 4
            opt.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
