"""RoPE settings in `StemlmConfig` (the causal-LM tester's RoPE-scaling checks, `tests/causal_lm_tester.py`, not in
the 5.24 sdist): transformers' `rope_parameters` / `rope_scaling` of any scaling type, which stemlm's decoder does
not read, are refused in one line rather than ignored, directly and from a folder's config.json; a
`rope_parameters` that only restates `rope_theta` is accepted.
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from stemlm.errors import StemlmError
from stemlm.hf import StemlmConfig


@pytest.mark.parametrize(
    "settings",
    [
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}},  # disagrees with rope_theta
    ],
)
def test_rope_settings_the_decoder_does_not_read_are_refused(settings):
    with pytest.raises(StemlmError, match="RoPE settings only as rope_theta and rope_llama3") as error:
        StemlmConfig(**settings)
    assert "\n" not in str(error.value)


def test_rope_parameters_restating_rope_theta_are_accepted():
    config = StemlmConfig(rope_theta=500.0, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    assert config.to_model_config().rope_theta == 500.0


def test_a_folder_with_linear_scaling_is_refused(tmp_path):
    StemlmConfig().save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": data["rope_theta"]}
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(StemlmError, match="linear, dynamic and other scaling types are not implemented"):
        AutoConfig.from_pretrained(tmp_path)
