"""`value_embed` in `stemlm experiment compare --kinds`: a kind of the registry, so it is accepted, configured like
every kind, FLOP-matched from its accounting (the mix adds no FLOPs: the dense budget buys the same steps) and
trained by a compare run with the tables' lr.

    OMP_NUM_THREADS=1 python -m pytest tests/experiments/test_compare_value_embed.py -q
"""

from __future__ import annotations

from stemlm.cli.main import main
from stemlm.experiments.compare import CompareConfig, kind_names, model_configs, plan_steps
from tests.experiments.compare_results import TOK, train_two_steps

SMALL = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=128,
    seq_len=32,
    batch_size=4,
)


def test_value_embed_is_a_compare_kind_matched_by_flops(tmp_path, capsys):
    assert "value_embed" in kind_names()
    assert main(["experiment", "compare", "--kinds", "value_embed,mamba", "--out", str(tmp_path / "cmp")]) == 2
    assert capsys.readouterr().err.strip().endswith("value_embed, dense_embed")  # unknown mamba; the choices
    cfg = CompareConfig(kinds=("dense", "value_embed", "stem"), budget="400", **SMALL)
    configs = model_configs(cfg, TOK)
    assert configs["value_embed"].ffn == "value_embed" and configs["value_embed"].special_layers == [1]
    steps = plan_steps(cfg, configs, "flops")
    assert steps["value_embed"] == steps["dense"] == 400 < steps["stem"]


def test_a_compare_run_trains_value_embed_with_the_table_lr(tmp_path):
    cfg = CompareConfig(kinds=("value_embed",), **SMALL)
    result = train_two_steps(cfg, "value_embed", tmp_path)
    assert result["fit"]["steps"] == 2 and result["table_lr"] is not None
    assert result["params_total"] > result["params_active"]  # the value table is not active per token
