"""Which checkpoints the vLLM plugin serves (the kinds that declare no `vllm_unserved` reason) and the one-line
reason it gives for every other kind; needs no vLLM (`stemlm.vllm.kinds` imports none), so it runs in the main
suite."""

from __future__ import annotations

import pytest
import torch

from stemlm.hf.configuration import StemlmConfig
from stemlm.model.config import FFN_KINDS
from stemlm.model.kinds.registry import beside_kinds, get_kind
from stemlm.vllm.kinds import check_servable, dtype_note, rope_parameters, served_kinds
from tests.conftest import TINY

SERVED = ("dense", "stem", "stem_ngram", "engram")  # the kinds stemlm/vllm/ffn.py has a module for


def hf_config(**fields) -> StemlmConfig:
    return StemlmConfig(**{**TINY, **fields})


def test_the_kinds_served_are_those_with_a_vllm_module():
    assert served_kinds() == SERVED


@pytest.mark.parametrize("ffn", SERVED)
def test_the_served_kinds_load(ffn):
    assert check_servable(hf_config(ffn=ffn)).ffn == ffn


@pytest.mark.parametrize("ffn", sorted(set(FFN_KINDS) - set(SERVED)))
def test_other_kinds_are_refused_with_the_reason_they_declare(ffn):
    reason = get_kind(ffn).vllm_unserved
    assert reason and "vLLM" in reason
    with pytest.raises(ValueError, match=f"serves dense, stem, stem_ngram, engram layers; not {ffn}: ") as refused:
        check_servable(hf_config(ffn=ffn))
    assert str(refused.value).endswith(reason)


def test_a_stem_layer_with_no_selected_layers_is_a_dense_model():
    assert check_servable(hf_config(ffn="stem", ffn_layers="none")).special_layers == []


@pytest.mark.parametrize("side", [kind.name for kind in beside_kinds()])
def test_a_kind_beside_the_ffn_is_served_or_refused_as_it_declares(side):
    config = hf_config(ffn="stem", engram_dim=64, **{f"{side}_layers": "0"})
    if get_kind(side).vllm_unserved is None:
        assert check_servable(config).beside_layers(side) == [0]
    else:
        with pytest.raises(ValueError, match=f"layers; not {side} \\({side}_layers\\): fits vLLM's step"):
            check_servable(config)


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


def test_a_dtype_other_than_the_recorded_one_is_noted():
    assert dtype_note(torch.float32, torch.float32) is None and dtype_note(None, torch.bfloat16) is None
    note = dtype_note(torch.float32, torch.bfloat16)
    assert "serving in bfloat16" in note and "pass --dtype float32" in note
