"""`stemlm.hf.autoregister`: whatever the order of imports and the first call that pulls in transformers' model code,
the Auto classes know stemlm afterwards (issue 39 point 1).

Each case runs in a fresh interpreter, since registration happens once per process: one of three import orders, then
one call (checkpointing on under either name, save, generate, a PEFT wrap, one `transformers.Trainer` step with
`gradient_checkpointing=True`), then `AutoConfig` and `AutoModelForCausalLM` load the saved folder and build from
the config made before the call. A registration that failed would show as a warning and as `ValueError:
Unrecognized configuration class`; both fail the case. Two fast tests drive `sync()` in this process with a
recording stand-in for `modeling_auto`: it waits while a watched module is half-imported, and a failed import
registers none of the five classes, warns once and is retried at the next `StemlmConfig`.
"""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
import types

import pytest

import stemlm.hf.heads
from stemlm.hf import autoregister

ORDERS = {
    # `import stemlm` first (the hook is installed before transformers loads), the classes from stemlm.hf later
    "stemlm_then_transformers": (
        "import stemlm\nimport transformers\nfrom stemlm.hf import StemlmConfig, StemlmForCausalLM"
    ),
    # transformers' auto modules already loaded when stemlm arrives
    "transformers_then_stemlm": (
        "from transformers import AutoModelForCausalLM\nfrom stemlm.hf import StemlmConfig, StemlmForCausalLM"
    ),
    # only stemlm.hf: transformers is imported by the classes themselves
    "stemlm_hf_only": "from stemlm.hf import StemlmConfig, StemlmForCausalLM",
}

CALLS = {
    "gradient_checkpointing_enable": "model.gradient_checkpointing_enable()",
    "activation_checkpointing_enable": "model.activation_checkpointing_enable()",
    "save_pretrained": "model.save_pretrained(folder + '-first')",
    "generate": "model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=3, do_sample=False)",
    "peft_wrap": (
        "from peft import LoraConfig, get_peft_model\n"
        "get_peft_model(model, LoraConfig(r=2, target_modules=['q_proj'], modules_to_save=['stem_embedding']))"
    ),
    "trainer_step": (
        "from transformers import Trainer, TrainingArguments\n"
        "rows = [{'input_ids': [3, 4, 5, 6], 'labels': [3, 4, 5, 6]}] * 2\n"
        "args = TrainingArguments(output_dir=folder + '-trainer', max_steps=1, per_device_train_batch_size=2,\n"
        "                         gradient_checkpointing=True, report_to=[], use_cpu=True, save_strategy='no')\n"
        "Trainer(model=model, args=args, train_dataset=rows).train()"
    ),
}

SCRIPT = """
import sys
{order}
import torch
folder = sys.argv[1]
config = StemlmConfig(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, ffn="stem", eos_token_id=2)
model = StemlmForCausalLM(config)
{call}
model.save_pretrained(folder)
from transformers import AutoConfig, AutoModelForCausalLM
assert type(AutoConfig.from_pretrained(folder)) is StemlmConfig
assert type(AutoModelForCausalLM.from_config(config)) is StemlmForCausalLM
assert type(AutoModelForCausalLM.from_pretrained(folder)) is StemlmForCausalLM
print("registered")
"""


@pytest.mark.slow  # 18 fresh interpreters importing torch and transformers: minutes on 2 busy cores
@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("order", ORDERS)
def test_registration_survives_every_import_order_and_first_call(tmp_path, order, call):
    code = SCRIPT.format(order=ORDERS[order], call=CALLS[call])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "model")], capture_output=True, text=True, env=env)
    assert run.returncode == 0 and run.stdout.split()[-1:] == ["registered"], run.stderr[-3000:]
    assert "could not register" not in run.stderr


class RecordingAuto:
    """Stands in for each Auto class of `modeling_auto`: records what is registered with it."""

    registered: list[str] = []

    @classmethod
    def register(cls, config_class, model_class, exist_ok=False) -> None:
        cls.registered.append(model_class.__name__)


AUTO_CLASSES = ("AutoModel", "AutoModelForCausalLM", "AutoModelForSequenceClassification",
                "AutoModelForTokenClassification", "AutoModelForQuestionAnswering")  # fmt: skip


@pytest.fixture
def unregistered(monkeypatch):
    """autoregister's state before the model classes are registered, with a recording `modeling_auto`."""
    monkeypatch.setattr(RecordingAuto, "registered", [])
    monkeypatch.setitem(
        sys.modules, autoregister.MODEL_AUTO, types.SimpleNamespace(**dict.fromkeys(AUTO_CLASSES, RecordingAuto))
    )
    for key, value in {"model_registered": False, "config_created": True, "warned": False}.items():
        monkeypatch.setitem(autoregister._state, key, value)
    return monkeypatch


def test_registration_waits_for_a_half_imported_module(unregistered):
    name = "transformers.modeling_layers"
    half = types.ModuleType(name)
    half.__spec__ = importlib.machinery.ModuleSpec(name, None)
    half.__spec__._initializing = True  # as importlib marks a module whose body is running
    unregistered.setitem(sys.modules, name, half)
    autoregister.sync()
    assert RecordingAuto.registered == [] and not autoregister._state["model_registered"]
    autoregister.sync(finished=name)  # its loader's end: the watched import is complete
    assert len(RecordingAuto.registered) == 5 and autoregister._state["model_registered"]


def test_a_failed_registration_registers_nothing_warns_once_and_is_retried(unregistered):
    unregistered.setitem(sys.modules, "stemlm.hf.heads", None)  # its import now fails
    with pytest.warns(UserWarning, match="could not register"):
        autoregister.sync()
    autoregister.config_created()  # a new config retries; it fails again, without a second warning
    assert RecordingAuto.registered == [] and not autoregister._state["model_registered"]
    unregistered.setitem(sys.modules, "stemlm.hf.heads", stemlm.hf.heads)
    autoregister.config_created()
    assert sorted(RecordingAuto.registered) == sorted(
        ["StemlmModel", "StemlmForCausalLM", "StemlmForSequenceClassification", "StemlmForTokenClassification",
         "StemlmForQuestionAnswering"]
    )  # fmt: skip
