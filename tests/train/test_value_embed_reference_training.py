"""`--train tables` on `value_embed_variant="reference"`: the tables, λ0 and the per-head gates keep learning.

OMP_NUM_THREADS=1 python -m pytest tests/train/test_value_embed_reference_training.py -q
"""

from __future__ import annotations

from stemlm.model import build_model
from stemlm.train.optim import freeze_backbone


def test_train_tables_keeps_the_gates_and_lambda_learning(tiny_config):
    cfg = tiny_config("value_embed", num_hidden_layers=8, ffn_layers="1,2,-3,-2,-1", value_embed_variant="reference")
    model = build_model(cfg)
    freeze_backbone(model)
    learning = sorted(name.split(".", 4)[-1] for name, p in model.named_parameters() if p.requires_grad)
    assert learning == sorted(["value_embedding.weight", "value_gate.weight", "value_lambda"] * 5)
