"""`--compile`: the STEM and dense forwards trace with no graph break, and a compiled run trains the same model
with the same parameter names (compiled here with dynamo's `eager` backend: the tracing without inductor's
C++ build, so the test stays fast on a CPU).

Run: `OMP_NUM_THREADS=1 python -m pytest tests/train/test_compile.py -q`.
"""

from __future__ import annotations

import pytest
import torch

from stemlm.model import build_model
from stemlm.model.config import ModelConfig
from stemlm.train import compile as compile_mod
from stemlm.train.trainer import Trainer
from tests.train.test_trainer import train_records


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("ffn", ["stem", "dense"])
def test_forward_has_no_graph_breaks(ffn):
    cfg = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, ffn=ffn,
                      ffn_layers="odd")  # fmt: skip
    model = build_model(cfg, seed=0)
    x, y = torch.randint(0, 300, (2, 16)), torch.randint(0, 300, (2, 16))
    explained = torch._dynamo.explain(model)(x, labels=y)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


def test_compiled_run_matches(tmp_path, monkeypatch, make_train_config, make_model_config):
    monkeypatch.setattr(compile_mod, "BACKEND", "eager")
    kw = dict(steps=2, eval_every=0)
    plain = Trainer(make_model_config("stem"), make_train_config(tmp_path / "a", **kw), progress=False)
    plain.fit()
    compiled = Trainer(make_model_config("stem"), make_train_config(tmp_path / "b", compile=True, **kw), progress=False)
    compiled.fit()
    assert [n for n, _ in compiled.model.named_parameters()] == [n for n, _ in plain.model.named_parameters()]
    a, b = train_records(tmp_path / "a" / "run"), train_records(tmp_path / "b" / "run")
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-6, abs=1e-6)
