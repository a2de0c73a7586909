"""transformers' own common model tests (`ModelTesterMixin`, `ConfigTester`) against every kind's config.

The test files come from the transformers sdist of the installed version, never from this repository:

    V=$(python -c 'import transformers; print(transformers.__version__)')
    pip download --no-deps --no-binary :all: transformers==$V -d /tmp/tf
    tar xzf /tmp/tf/transformers-*.tar.gz -C /tmp/tf
    STEMLM_TRANSFORMERS_SDIST=/tmp/tf/transformers-$V python -m pytest tests/hf/test_hf_common.py -q

`.ci/run` does the same before the tests (counts and skip reasons per kind: docs/hf.md). Without
`STEMLM_TRANSFORMERS_SDIST` (or with an sdist of another version) every test here is skipped with the reason.
The 5.x sdist ships `tests/test_modeling_common.py` and `tests/test_configuration_common.py` but not the modules
they import (`tests/exporters/test_export.py`, `tests/generation/test_utils.py`,
`tests/utils/test_configuration_utils.py`): empty mixins stand in for the first two, so the export and generation
testers do not run here, and `ConfigTester`'s checks run one by one but for `check_config_arguments_init`, whose
kwargs are in the third.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
import unittest
from pathlib import Path
from unittest import mock

import pytest
import transformers
from transformers.models.auto import modeling_auto

from stemlm.hf import StemlmConfig, StemlmForCausalLM, StemlmModel
from stemlm.model.config import FFN_KINDS, MODEL_TYPE
from stemlm.model.kinds.registry import get_kind

SDIST = Path(os.environ.get("STEMLM_TRANSFORMERS_SDIST", "/nonexistent"))
PACKAGE = "transformers_sdist_tests"  # the sdist's tests/ folder, imported as a package under this name


def _import_common():
    """The sdist's `test_modeling_common` module, or the reason it cannot be imported."""
    tests = SDIST / "tests"
    if not (tests / "test_modeling_common.py").is_file():
        return None, "set STEMLM_TRANSFORMERS_SDIST to the unpacked transformers sdist (see this file's docstring)"
    version = SDIST.name.removeprefix("transformers-")
    if version != transformers.__version__:
        return None, f"the sdist is transformers {version}, the installed one {transformers.__version__}"
    if PACKAGE not in sys.modules:
        package = types.ModuleType(PACKAGE)
        package.__path__ = [str(tests)]
        sys.modules[PACKAGE] = package
        # Stand-ins for the modules the sdist does not ship (see the docstring): mixins without tests.
        stand_ins = (
            ("exporters.test_export", "ExportTesterMixin", type("ExportTesterMixin", (), {})),
            ("generation.test_utils", "GenerationTesterMixin", type("GenerationTesterMixin", (), {})),
            ("utils.test_configuration_utils", "config_common_kwargs", None),  # only check_config_arguments_init
        )
        for name, attr, value in stand_ins:
            parent = f"{PACKAGE}.{name.split('.')[0]}"
            sys.modules.setdefault(parent, types.ModuleType(parent)).__path__ = []
            module = types.ModuleType(f"{PACKAGE}.{name}")
            setattr(module, attr, value)
            sys.modules[module.__name__] = module
    try:
        return importlib.import_module(f"{PACKAGE}.test_modeling_common"), None
    except ModuleNotFoundError as exc:  # its test-only requirements (parameterized, ...)
        return None, f"the sdist's tests need {exc.name} (pip install {exc.name})"


common, SKIP_REASON = _import_common()
pytestmark = pytest.mark.skipif(common is None, reason=SKIP_REASON or "")
ModelTesterMixin = common.ModelTesterMixin if common is not None else object

# ConfigTester.run_common_tests, check by check, but check_config_arguments_init: its kwargs are not in the sdist.
CONFIG_CHECKS = (
    "create_and_test_config_common_properties",
    "create_and_test_config_to_json_string",
    "create_and_test_config_to_json_file",
    "create_and_test_config_from_and_save_pretrained",
    "create_and_test_config_from_and_save_pretrained_subfolder",
    "create_and_test_config_from_and_save_pretrained_composite",
    "create_and_test_config_with_num_labels",
    "create_and_test_config_from_pretrained_custom_kwargs",
    "check_config_can_be_init_without_params",
)


class StemlmModelTester:
    """Tiny configs and inputs in the shape `ModelTesterMixin` expects (its `model_tester`)."""

    batch_size, seq_length, vocab_size = 2, 7, 99
    hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads = 32, 2, 4, 2
    is_training = True

    def __init__(self, parent, ffn: str) -> None:
        self.parent, self.ffn = parent, ffn

    def get_config(self) -> StemlmConfig:
        return StemlmConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=37,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=512,
            ffn=self.ffn,
            ffn_layers="all",
            memory_keys=16,  # memory's default (128² value rows) passes the testers' 1M-parameter cap
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )

    def prepare_config_and_inputs_for_common(self):
        input_ids = common.ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = common.random_attention_mask([self.batch_size, self.seq_length])  # as transformers' testers
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


class _CommonTests(ModelTesterMixin):
    ffn = "dense"
    all_model_classes = (StemlmModel, StemlmForCausalLM)

    def setUp(self) -> None:
        self.model_tester = StemlmModelTester(self, self.ffn)
        # The testers tell a base model from a causal LM by class name in transformers' static name tables, where an
        # in-tree model is listed; ours is registered at run time, so it is listed for the test's duration.
        for table, name in ((modeling_auto.MODEL_MAPPING_NAMES, "StemlmModel"),
                            (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "StemlmForCausalLM")):  # fmt: skip
            self.enterContext(mock.patch.dict(table, {MODEL_TYPE: name}))

    def test_generation_tester_mixin_inheritance(self):
        self.skipTest("the sdist ships no tests/generation, so no GenerationTesterMixin to inherit")


class _ReadsIdsTests(_CommonTests):
    # inputs_embeds without input_ids: the kind's tables or routing are indexed by token id (Kind.reads_input_ids),
    # so that is refused by construction.
    def test_inputs_embeds(self):
        self.skipTest("inputs_embeds without input_ids: this kind reads the token ids")

    def test_inputs_embeds_matches_input_ids(self):
        self.skipTest("inputs_embeds without input_ids: this kind reads the token ids")


# One test class per kind, found in the registry: DenseCommonTest, StemCommonTest, ...
for _kind in FFN_KINDS:
    _name = "".join(part.title() for part in _kind.split("_")) + "CommonTest"
    _base = _ReadsIdsTests if get_kind(_kind).reads_input_ids() else _CommonTests
    globals()[_name] = type(_name, (_base, unittest.TestCase), {"ffn": _kind})


@pytest.mark.parametrize("check", CONFIG_CHECKS)
@pytest.mark.parametrize("ffn", FFN_KINDS)
def test_config_common(check, ffn):
    # Its module imports tests/__init__.py as a transformers package (unused after that), a file the sdist lacks.
    with mock.patch("transformers.utils.direct_transformers_import", lambda path: transformers):
        config_tests = importlib.import_module(f"{PACKAGE}.test_configuration_common")
    case = unittest.TestCase()
    tester = config_tests.ConfigTester(case, config_class=StemlmConfig, hidden_size=40, ffn=ffn, ffn_layers="all")
    getattr(tester, check)()
