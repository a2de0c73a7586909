"""Which checkpoints the vLLM plugin serves (dense and STEM) and the one-line reason it gives for every other kind;
needs no vLLM (`stemlm.vllm.kinds` imports none), so it runs in the main suite."""

from __future__ import annotations

import pytest

from stemlm.hf.configuration import StemlmConfig
from stemlm.model.config import FFN_KINDS
from stemlm.model.kinds.registry import beside_kinds
from stemlm.vllm.kinds import NEEDS_HISTORY, NOT_WRITTEN, SERVED, check_servable, rope_parameters
from tests.conftest import TINY


def hf_config(**fields) -> StemlmConfig:
    return StemlmConfig(**{**TINY, **fields})


@pytest.mark.parametrize("ffn", SERVED)
def test_dense_and_stem_are_served(ffn):
    assert check_servable(hf_config(ffn=ffn)).ffn == ffn


def test_every_kind_is_served_or_has_a_reason():
    assert set(FFN_KINDS) == set(SERVED) | set(NOT_WRITTEN) | set(NEEDS_HISTORY)
    assert not set(SERVED) & set(NOT_WRITTEN) and not set(NOT_WRITTEN) & set(NEEDS_HISTORY)


@pytest.mark.parametrize("ffn", sorted(set(FFN_KINDS) - set(SERVED)))
def test_other_kinds_are_refused_with_the_reason(ffn):
    with pytest.raises(ValueError, match=f"serves dense and STEM layers only: {ffn} ") as refused:
        check_servable(hf_config(ffn=ffn))
    reason = NOT_WRITTEN.get(ffn) or NEEDS_HISTORY[ffn]
    assert reason in str(refused.value)


def test_a_stem_layer_with_no_selected_layers_is_a_dense_model():
    assert check_servable(hf_config(ffn="stem", ffn_layers="none")).special_layers == []


@pytest.mark.parametrize("side", [kind.name for kind in beside_kinds()])
def test_a_kind_beside_the_ffn_is_refused(side):
    with pytest.raises(ValueError, match=f"only: {side} "):
        check_servable(hf_config(ffn="stem", **{f"{side}_layers": "0"}))


def test_int8_tables_are_refused_bf16_tables_load():
    storage = {"dtype": "int8", "tensors": [], "scale_suffix": "_scale"}
    with pytest.raises(ValueError, match="--table-dtype bf16"):
        check_servable(hf_config(ffn="stem", stemlm_table_storage=storage))
    assert check_servable(hf_config(ffn="stem", stemlm_table_storage={**storage, "dtype": "bf16"})).ffn == "stem"


def test_rope_settings_are_vllm_get_rope_parameters():
    assert rope_parameters(hf_config(rope_theta=500000.0).to_model_config()) == {
        "rope_type": "default", "rope_theta": 500000.0,
    }  # fmt: skip
    llama3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    assert rope_parameters(hf_config(rope_llama3=llama3).to_model_config()) == {
        "rope_type": "llama3", "rope_theta": 10000.0, **llama3,
    }  # fmt: skip
