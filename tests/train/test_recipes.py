"""`--recipe official` rule by rule against plain re-computations, and two steps against a plain-torch official update.

The rules (stemlm.train.recipes, from the official STEM code): truncated-normal init at ±3σ (σ = initializer_range
for the projections, d^-½ for the embedding and an untied head), one AdamW over the backbone with the norm gains
decayed, a dense table AdamW, a clip per optimizer, and lingua's warm-up factor step/warmup. The default recipe
(`stemlm`) is tests/train/test_optim.py's. Run: `OMP_NUM_THREADS=1 python -m pytest tests/train/test_recipes.py -q`.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from stemlm.errors import StemlmError
from stemlm.model import build_model
from stemlm.model.config import FFN_KINDS
from stemlm.train.config import TrainConfig
from stemlm.train.recipes import (
    get_recipe,
    official_init_specs,
    official_lr_multiplier,
    train_config,
    uncovered_parameters,
)
from stemlm.train.trainer import Trainer
from tests.train.conftest import changed_fields

OFFICIAL = get_recipe("official")


def _official_cfg(**changes) -> TrainConfig:
    return train_config({"recipe": "official", **changes})


def test_train_config_gives_the_tables_the_backbone_settings():
    cfg = _official_cfg(lr=3e-4)
    assert (cfg.table_optim, cfg.table_peak_lr, cfg.table_wd) == ("adamw", 3e-4, cfg.weight_decay)
    assert _official_cfg(weight_decay=0.05).table_wd == 0.05  # "same settings" follows --weight-decay
    later = _official_cfg(lr=3e-4, table_lr=5e-4, table_wd=0.0)  # the later configs' table options
    assert (later.table_peak_lr, later.table_wd) == (5e-4, 0.0)
    assert train_config({}) == TrainConfig()  # the default recipe's config is untouched
    with pytest.raises(StemlmError, match="dense AdamW"):
        _official_cfg(table_optim="rowwise_adagrad")
    with pytest.raises(StemlmError, match="recipe must be one of stemlm, official"):
        TrainConfig(recipe="lingua")


def test_lr_is_lingua_cosine_with_step_over_warmup():
    # lr_cosine, one cycle, theta 1: step / warmup, then min + (1 - min) (1 + cos(pi s)) / 2, s = (step - w) / (n - w)
    warmup, steps, floor = 4, 14, 0.1
    expected = [s / warmup for s in range(warmup)]
    expected += [floor + (1 - floor) * (1 + math.cos(math.pi * (s - warmup) / 10)) / 2 for s in range(warmup, steps)]
    got = [official_lr_multiplier(s, warmup, steps, floor) for s in range(steps)]
    assert got[0] == 0.0 and got[warmup] == 1.0
    assert got == pytest.approx(expected, rel=0, abs=1e-15)
    cfg = _official_cfg(steps=steps, warmup=warmup, min_lr_ratio=floor)
    assert [OFFICIAL.lr_multiplier(s, cfg) for s in range(steps)] == got


def test_one_backbone_group_decays_the_norm_gains(make_model_config):
    # With zero gradients AdamW's update is the decoupled decay alone: w <- w * (1 - lr * wd), norms included.
    model = build_model(make_model_config("stem"))
    cfg = _official_cfg(lr=0.1, weight_decay=0.5, table_lr=0.2, table_wd=0.25)
    opts = OFFICIAL.build_optimizers(model, cfg)
    assert [[g["name"] for g in o.param_groups] for o in opts] == [["backbone"], ["tables"]]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for opt in opts:
        opt.step()
    tables = {f"model.layers.{i}.mlp.stem_embedding.weight" for i in model.token_tables()}
    assert tables and any(n.endswith("norm.weight") for n in before)
    for name, p in model.named_parameters():
        factor = 1 - 0.2 * 0.25 if name in tables else 1 - 0.1 * 0.5
        torch.testing.assert_close(p.detach(), before[name] * factor, rtol=1e-6, atol=0)


def test_gradients_are_clipped_per_optimizer(make_model_config):
    model = build_model(make_model_config("stem"))
    opts = OFFICIAL.build_optimizers(model, _official_cfg())
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    groups = [[p for g in o.param_groups for p in g["params"]] for o in opts]
    norms = [math.sqrt(sum(float(p.grad.double().square().sum()) for p in ps)) for ps in groups]
    raw = [[p.grad.clone() for p in ps] for ps in groups]
    max_norm = min(norms) / 2  # both groups above the limit: each is scaled to it on its own
    total = OFFICIAL.clip_gradients(opts, max_norm)
    assert float(total) == pytest.approx(math.hypot(*norms), rel=1e-6)
    for ps, grads, norm in zip(groups, raw, norms, strict=True):
        coef = max_norm / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s scale
        for p, g in zip(ps, grads, strict=True):
            torch.testing.assert_close(p.grad, g * coef, rtol=1e-5, atol=0)


@pytest.mark.parametrize(("ffn", "tied"), [("stem", False), ("stem", True), ("stem_gate", False)])
def test_init_is_truncated_normal_with_the_official_stds(make_model_config, ffn, tied):
    config = make_model_config(ffn, tie_word_embeddings=tied)
    model = build_model(config, seed=3)
    default = {n: p.detach().clone() for n, p in model.named_parameters()}
    OFFICIAL.init_weights(model, seed=3)
    d, std = config.hidden_size, config.initializer_range
    expected = {}
    for name, param in model.named_parameters():
        leaf = name.rsplit(".", 2)[-2]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            expected[name] = d**-0.5  # always d^-1/2, as LMTransformer.reset_parameters is called without a std
        elif leaf in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            expected[name] = std  # init_base_std set: the code gives it to w2 too (d_ff^-1/2 only when unset)
        else:  # norm gains (ones) and the tables (xavier) keep the model's own init
            assert torch.equal(param, default[name]), name
    assert {n: s for n, _, s in official_init_specs(model)} == expected
    assert ("lm_head.weight" in expected) is not tied
    gen = torch.Generator().manual_seed(3)
    for name, param in model.named_parameters():
        if name in expected:  # the same draws, by hand, in named_parameters order
            s = expected[name]
            redraw = torch.nn.init.trunc_normal_(torch.empty(param.shape), 0.0, s, -3 * s, 3 * s, generator=gen)
            assert torch.equal(param.detach(), redraw), name
            assert float(param.detach().abs().max()) <= 3 * s
            assert float(param.detach().std()) == pytest.approx(0.9866 * s, rel=0.05)  # a ±3σ truncated normal's std
    assert tied is (model.lm_head.weight is model.model.embed_tokens.weight)


@pytest.mark.parametrize("ffn", FFN_KINDS)
def test_official_rules_cover_dense_stem_and_stem_gate_only(make_model_config, ffn):
    model = build_model(make_model_config(ffn), device="meta")
    uncovered = uncovered_parameters(model)
    if ffn in ("dense", "stem", "stem_gate"):
        assert uncovered == []
        return
    assert uncovered and not any(n.startswith("model.") for n in uncovered)  # named within their layer
    with pytest.raises(StemlmError, match=f"no init or optimizer rule for {ffn}'s {uncovered[0]}"):
        OFFICIAL.init_weights(model, seed=0)
    with pytest.raises(StemlmError, match=f"for {ffn}'s"):  # a resumed run builds its optimizers only
        OFFICIAL.build_optimizers(model, _official_cfg())


def test_recipe_refusals(tmp_path, make_train_config, make_model_config):
    Trainer(make_model_config("stem"), make_train_config(tmp_path, steps=2, eval_every=0), progress=False).fit()
    with pytest.raises(StemlmError, match="trained with --recipe stemlm; it cannot resume as --recipe official"):
        Trainer.resume(tmp_path / "run", overrides={"steps": 3, "recipe": "official"})


def test_official_run_records_and_resumes_its_recipe(tmp_path, make_train_config, make_model_config):
    base = changed_fields(make_train_config(tmp_path, eval_every=0))
    cfg = train_config({**base, "recipe": "official", "steps": 2})
    Trainer(make_model_config("stem"), cfg, progress=False).fit()
    saved = json.loads((tmp_path / "run" / "run_config.json").read_text())["train"]
    assert (saved["recipe"], saved["table_optim"], saved["table_wd"]) == ("official", "adamw", 0.1)
    resumed = Trainer.resume(tmp_path / "run", overrides={"steps": 3}, progress=False)
    assert resumed.recipe.name == "official" and resumed.fit()["steps"] == 3


def _official_update_by_hand(model, batches, *, tables, lr, table_lr, wd, table_wd, clip, warmup, steps, floor):
    """The official step written out in plain torch: per-optimizer clip, AdamW with decoupled decay, lr_cosine."""
    b1, b2, eps = 0.9, 0.95, 1e-8
    params = dict(model.named_parameters())
    groups = [
        ([n for n in params if n not in tables], lr, wd),
        ([n for n in params if n in tables], table_lr, table_wd),
    ]
    m = {n: torch.zeros_like(p) for n, p in params.items()}
    v = {n: torch.zeros_like(p) for n, p in params.items()}
    norms_seen = []
    for step, (x, y) in enumerate(batches):
        model.zero_grad(set_to_none=True)
        model(x, labels=y).loss.backward()
        factor = (
            step / warmup
            if step < warmup
            else floor + (1 - floor) * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup))) / 2
        )
        with torch.no_grad():
            for names, peak, decay in groups:
                norm = torch.sqrt(sum(params[n].grad.square().sum() for n in names))
                norms_seen.append(float(norm))
                scale = min(1.0, clip / (float(norm) + 1e-6))
                t = step + 1
                for n in names:
                    p, g = params[n], params[n].grad * scale
                    m[n] = b1 * m[n] + (1 - b1) * g
                    v[n] = b2 * v[n] + (1 - b2) * g * g
                    p.mul_(1 - peak * factor * decay)
                    p.sub_(peak * factor * (m[n] / (1 - b1**t)) / ((v[n] / (1 - b2**t)).sqrt() + eps))
    return norms_seen


def test_two_steps_equal_the_official_update_in_fp64(tmp_path, make_train_config, make_model_config):
    # Warm-up 1: the first update is at lr 0 (moments only), the second at the full lr; clip 0.01 clips both groups.
    changes = dict(steps=2, warmup=1, eval_every=0, lr=3e-3, table_lr=5e-3, table_wd=0.02, grad_clip=0.01)
    cfg = train_config({**changed_fields(make_train_config(tmp_path)), **changes, "recipe": "official"})
    trainer = Trainer(make_model_config("stem"), cfg, progress=False)
    trainer.model.double()
    trainer.optimizers = trainer._build_optimizers()  # over the fp64 parameters
    reference = copy.deepcopy(trainer.model)
    batches = [trainer.batches.sample(step) for step in range(cfg.steps)]
    for _ in range(cfg.steps):
        assert not trainer.train_step()["skipped"]
    tables = {f"model.layers.{i}.mlp.stem_embedding.weight" for i in reference.token_tables()}
    norms = _official_update_by_hand(
        reference,
        batches,
        tables=tables,
        lr=cfg.lr,
        table_lr=cfg.table_peak_lr,
        wd=cfg.weight_decay,
        table_wd=cfg.table_wd,
        clip=cfg.grad_clip,
        warmup=cfg.warmup_steps,
        steps=cfg.steps,
        floor=cfg.min_lr_ratio,
    )
    assert min(norms) > cfg.grad_clip  # every clip was active, so clipping per optimizer is what is compared
    ours = dict(trainer.model.named_parameters())
    for name, p in reference.named_parameters():
        assert p.dtype == torch.float64
        assert float((ours[name] - p).detach().abs().max()) <= 1e-12, name  # measured: 6e-17
    initial = build_model(make_model_config("stem"), seed=cfg.seed)
    OFFICIAL.init_weights(initial, cfg.seed)
    for name, p in initial.named_parameters():  # the second update moved every tensor, norm gains included
        assert float((ours[name] - p.double()).detach().abs().max()) > 1e-6, name
