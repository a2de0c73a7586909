"""Named model presets: `tiny` for CPU work, and the paper's 350M and 1B shapes, each with a dense twin.

A preset is a function returning a `ModelConfig`; `get_preset(name)` finds it by name and `list_presets()`
lists them (the CLI shows this list). `<name>-dense` is the same shape with every FFN dense.
"""

from __future__ import annotations

from collections.abc import Callable

from stemlm.errors import StemlmError
from stemlm.model.config import ModelConfig


def tiny() -> ModelConfig:
    # The prototype's shape (../shared/PAPER.md): d 256, 4 layers, d_ff 768, vocab 8192; STEM in layers 1 and 3,
    # the paper's best "1/2 of the layers" placement, which also measured best at this scale.
    return ModelConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        ffn="stem",
        stem_layers="odd",
    )


def paper_350m() -> ModelConfig:
    # Later official commits: d 960, 32 layers, 15 heads / 5 KV, head_dim 64, V 32k, tied; STEM in every second
    # layer (the paper's best 350M variant). d_ff 2560 = 8/3 · d, the Llama/Lingua convention. Totals: 1.62B (0.31B
    # active), dense twin 0.35B; the paper reports 1.85B / 0.34B / 0.37B, so its 350M runs were somewhat wider.
    return ModelConfig(
        vocab_size=32000,
        hidden_size=960,
        intermediate_size=2560,
        num_hidden_layers=32,
        num_attention_heads=15,
        num_key_value_heads=5,
        head_dim=64,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        ffn="stem",
        stem_layers="odd",
    )


def paper_1b() -> ModelConfig:
    # Llama-3.2-1B shape; untied embeddings, as the paper's 1.50B baseline count implies; 5 STEM layers.
    return ModelConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        ffn="stem",
        stem_layers="every:3",
    )


_BASE: dict[str, Callable[[], ModelConfig]] = {"tiny": tiny, "paper-350m": paper_350m, "paper-1b": paper_1b}


def list_presets() -> list[str]:
    names = []
    for name in _BASE:
        names += [name, f"{name}-dense"]
    return names


def get_preset(name: str) -> ModelConfig:
    base, dense = (name[: -len("-dense")], True) if name.endswith("-dense") else (name, False)
    if base not in _BASE:
        raise StemlmError(f"unknown preset {name!r}; available: {', '.join(list_presets())}")
    config = _BASE[base]()
    return config.replace(ffn="dense") if dense else config
