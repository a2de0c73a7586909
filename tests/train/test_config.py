"""TrainConfig: defaults, derived values, validation messages and `key=value` overrides.

Run: `OMP_NUM_THREADS=1 python -m pytest tests/train/test_config.py -q`.
"""

from __future__ import annotations

import pytest

from stemlm.errors import StemlmError
from stemlm.train.config import TrainConfig


def test_derived_values():
    cfg = TrainConfig(steps=400, lr=2e-3, batch_size=8, seq_len=256, grad_accum=3)
    assert cfg.warmup_steps == 40  # 10% of steps when warmup is None
    assert cfg.table_peak_lr == pytest.approx(2e-2)  # lr x table_lr_scale (10)
    assert cfg.tokens_per_step == 8 * 256 * 3
    assert TrainConfig(warmup=7).warmup_steps == 7
    assert TrainConfig(table_lr=5e-4).table_peak_lr == 5e-4


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"steps": 0}, "steps must be a positive integer"),
        ({"steps": -3}, "steps must be a positive integer"),
        ({"batch_size": 0}, "batch_size must be a positive integer"),
        ({"lr": -1.0}, "lr must be a positive number"),
        ({"lr": float("nan")}, "lr must be a positive number"),
        ({"weight_decay": -0.1}, "weight_decay must be a non-negative number"),
        ({"beta2": 1.0}, "beta2 must lie in [0, 1)"),
        ({"steps": 200, "warmup": 200}, "warmup (200) must be smaller than steps (200)"),
        ({"dtype": "fp16"}, "dtype must be one of auto, fp32, bf16"),
        ({"table_optim": "sgd"}, "table_optim must be one of"),
        ({"save_every": -1}, "save_every must be a non-negative integer"),
        ({"data": []}, "data must be a non-empty list"),
        ({"steps": True}, "steps must be a positive integer"),
    ],
)
def test_validation_messages(changes, fragment):
    with pytest.raises(StemlmError, match="invalid training config") as info:
        TrainConfig(**changes)
    assert fragment in str(info.value)


def test_overrides_parse_by_field_type():
    cfg = TrainConfig().with_overrides(
        ["train.steps=12", "lr=1e-3", "table_lr=none", "warmup=3", "data=a.txt,b.txt", "tokenizer=gpt2"]
    )
    assert (cfg.steps, cfg.lr, cfg.table_lr, cfg.warmup) == (12, 1e-3, None, 3)
    assert cfg.data == ["a.txt", "b.txt"] and cfg.tokenizer == "gpt2"
    assert TrainConfig().with_overrides({"table_lr": 0.01}).table_lr == 0.01


@pytest.mark.parametrize(
    "item, fragment",
    [
        ("stepz=3", "unknown training config key 'stepz'"),
        ("steps=three", "expects an integer"),
        ("lr=fast", "expects a number"),
        ("steps", "not of the form key=value"),
    ],
)
def test_bad_overrides(item, fragment):
    with pytest.raises(StemlmError, match=fragment):
        TrainConfig().with_overrides([item])


def test_dict_round_trip_and_unknown_keys():
    cfg = TrainConfig(steps=9, data=["x"], table_lr=1e-3)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(StemlmError, match="unknown training config keys bogus"):
        TrainConfig.from_dict({**cfg.to_dict(), "bogus": 1})


def test_table_lr_as_a_number_or_a_multiple():
    from stemlm.train.config import table_lr_fields

    assert table_lr_fields("3e-3") == {"table_lr": 3e-3}
    assert table_lr_fields("x4") == {"table_lr": None, "table_lr_scale": 4.0}
    with pytest.raises(StemlmError, match="--table-lr 'fast'"):
        table_lr_fields("fast")


def test_a_saved_config_trains_on_as_it_was_written():
    """A run config written before a field existed resumes with what that run trained with, not today's default:
    no fact mix before `fact_fraction`, whole fact documents before `fact_layout`."""
    from stemlm.train.config import saved_defaults

    assert saved_defaults({}) == {"fact_fraction": 0.0, "fact_layout": "documents"}
    assert saved_defaults({"fact_fraction": 0.8}) == {"fact_layout": "documents"}
    assert saved_defaults(TrainConfig().to_dict()) == {}
    assert TrainConfig().fact_layout == "batches"
