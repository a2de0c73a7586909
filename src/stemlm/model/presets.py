"""Named model presets, each saying where its shape comes from: `tiny` for CPU work, the official STEM configs
(`paper-350m`, `paper-1b`), and the layouts that reproduce something else under names that say what.

A preset is a function returning a `ModelConfig`; its docstring names its source (the official config file and
commit, or the paper's table) and `preset_source(name)` returns that text (`stemlm info --preset P` prints it).
`get_preset(name)` finds a preset by name and `list_presets()` lists them (the CLI shows this list).
`<name>-dense` is the same shape with every FFN dense. docs/recipe.md sets them side by side with the official
code and the paper.

The official configs `stem_mobilellm_350M.yaml` and `stem_llama3_1B.yaml` are later commits of Infini-AI-Lab/STEM
than the snapshot stemlm was compared with (`main` at dcc9b73, `pr` at 54cb637): their values here are those
stated in stemlm issue 27, which read them; the d_ff of each is the official rounding of its shape
(multiple_of 256 over int(2/3 · 4d), times ffn_dim_multiplier for Llama-3.2-1B).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from stemlm.errors import StemlmError
from stemlm.model.config import ModelConfig


def _tiny(ffn_layers) -> ModelConfig:
    return ModelConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        ffn="stem",
        ffn_layers=ffn_layers,
    )


def tiny() -> ModelConfig:
    """The prototype's shape (PAPER.md): d 256, 4 layers, d_ff 768, vocab 8192, with STEM in every layer (the
    paper's "all layers" variant): a token's table rows are then the only place its identity enters an FFN, so
    a swap of table rows alone moves what the model recalls about it (with layer 0 dense, its FFN wrote the
    entity from the embedding into the residual and the swap needed embedding rows too: docs/results.md
    "The default run")."""
    return _tiny("all")


def tiny_odd() -> ModelConfig:
    """stemlm's `tiny` until 2026-12-06: the prototype's shape with STEM in layers 1 and 3 (the paper's best
    "1/2 of the layers" placement, which also measured best for held-out loss at this scale); kept so that the
    measurements made with it can name it."""
    return _tiny("odd")


def _mobilellm_350m(ffn_layers) -> ModelConfig:
    # d_ff 2560 = the official rounding of int(2/3 · 4 · 960) to a multiple of 256.
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
        ffn_layers=ffn_layers,
    )


def paper_350m() -> ModelConfig:
    """The official 350M config, `apps/main/configs/stem_mobilellm_350M.yaml` of Infini-AI-Lab/STEM (a commit
    after main@dcc9b73; values as stemlm issue 27 reads them, also its `iir` / `sss` variants): d 960, 32 layers,
    15 heads / 5 KV, head_dim 64, vocab 32000, tied embeddings, θ 1e4, STEM in layers 2, 4, ..., 26 (13 layers).
    Its totals do not reproduce the paper's 350M figures (1.85B / 0.34B)."""
    return _mobilellm_350m(list(range(2, 27, 2)))


def paper_350m_odd() -> ModelConfig:
    """stemlm's earlier `paper-350m`: the official 350M shape with STEM in every odd layer (1, 3, ..., 31: 16
    layers), the paper's "1/2 of the layers" placement. No official config file or paper table has this layout;
    kept so that runs made with the earlier preset can name it."""
    return _mobilellm_350m("odd")


def _llama32_1b(ffn_layers, tied: bool) -> ModelConfig:
    # Llama-3.2-1B: d_ff 8192 = the official rounding of int(1.5 · int(2/3 · 4 · 2048)) to a multiple of 256.
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
        tie_word_embeddings=tied,
        ffn="stem",
        ffn_layers=ffn_layers,
    )


def paper_1b() -> ModelConfig:
    """The official 1B config, `apps/main/configs/stem_llama3_1B.yaml` of Infini-AI-Lab/STEM (a commit after
    main@dcc9b73; values as stemlm issue 27 reads them): the Llama-3.2-1B shape (d 2048, 16 layers, 32 heads /
    8 KV, d_ff 8192, vocab 128256), tied embeddings, θ 5e5, STEM in layers 2, 6, 10, 14."""
    return _llama32_1b([2, 6, 10, 14], tied=True)


def paper_1b_odd() -> ModelConfig:
    """The official 1B shape with STEM in the odd layers 1, 3, ..., 15, as the official inference engine builds it
    (Infini-AI-Lab/STEM pr@54cb637, `inference/Engine/model.py`, config "llama-3.2-1b": `ffn_layers=list(range(1,
    16, 2))`) and, per stemlm issue 27, the official mid-training config; tied embeddings, θ 5e5."""
    return _llama32_1b("odd", tied=True)


def paper_1b_counts() -> ModelConfig:
    """The layout that reproduces the paper's 1B table (PAPER.md: 6.75B total / 1.41B active / 2.83 GFLOPs per
    token against a 1.50B dense baseline; `stemlm info --preset paper-1b-counts` shows the match): the
    Llama-3.2-1B shape untied, as the 1.50B baseline implies, STEM in 5 layers (every third: 2, 5, 8, 11, 14).
    stemlm's `paper-1b` before the official configs were read; no official config has this layout."""
    return _llama32_1b("every:3", tied=False)


_BASE: dict[str, Callable[[], ModelConfig]] = {
    "tiny": tiny,
    "tiny-odd": tiny_odd,
    "paper-350m": paper_350m,
    "paper-350m-odd": paper_350m_odd,
    "paper-1b": paper_1b,
    "paper-1b-odd": paper_1b_odd,
    "paper-1b-counts": paper_1b_counts,
}


def list_presets() -> list[str]:
    names = []
    for name in _BASE:
        names += [name, f"{name}-dense"]
    return names


def _split(name: str) -> tuple[str, bool]:
    base, dense = (name[: -len("-dense")], True) if name.endswith("-dense") else (name, False)
    if base not in _BASE:
        raise StemlmError(f"unknown preset {name!r}; available: {', '.join(list_presets())}")
    return base, dense


def get_preset(name: str) -> ModelConfig:
    base, dense = _split(name)
    config = _BASE[base]()
    return config.replace(ffn="dense") if dense else config


def preset_source(name: str) -> str:
    """Where preset `name` comes from: its function's docstring on one line (a `-dense` twin says so first)."""
    base, dense = _split(name)
    text = " ".join(inspect.getdoc(_BASE[base]).split())
    return f"every FFN dense, otherwise {base}: {text}" if dense else text
