"""Fine-tuning a stemlm checkpoint with `transformers.Trainer` (issue 39 point 4), as a transformers user would:
`gradient_checkpointing=True`, the whole model or a LoRA adapter from PEFT with the STEM tables trained whole
(`modules_to_save`), a falling loss, and the result saved by the Trainer and loaded back through
`AutoModelForCausalLM` (for the adapter: transformers' PEFT integration reads adapter_config.json and loads the
base folder it names). The snippet in docs/hf.md is this test's first case.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from tests.hf.test_hf import VOCAB, random_ids, saved_stemlm, tiny_config
from tests.hf.test_peft import TARGETS


def train(model, out, checkpointing: str, steps: int = 12):
    """Trainer on 8 fixed sequences, one batch (labels = inputs: the model learns them), with activation
    checkpointing asked for by `checkpointing`: the 5.25 name of the argument, or its deprecated one."""
    rows = [{"input_ids": row, "labels": row} for row in random_ids(8, 16, seed=40).tolist()]
    args = TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-2,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True, **{checkpointing: True},
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return trainer, losses


@pytest.mark.parametrize("checkpointing", ["activation_checkpointing", "gradient_checkpointing"])
@pytest.mark.parametrize("lora", [False, True])
def test_trainer_fine_tunes_with_checkpointing_and_saves_for_the_auto_classes(tmp_path, lora, checkpointing):
    _, folder = saved_stemlm(tmp_path, tiny_config("stem"))
    model = AutoModelForCausalLM.from_pretrained(folder)
    if lora:
        config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, modules_to_save=["stem_embedding"])
        model = get_peft_model(model, config)
    layers = model.get_base_model().model.layers if lora else model.model.layers
    trainer, losses = train(model, tmp_path / "run", checkpointing)
    assert all(layer.gradient_checkpointing for layer in layers)  # the Trainer turned it on, layer by layer
    assert len(losses) == 12 and losses[-1] < 0.8 * losses[0], losses

    trainer.save_model(str(tmp_path / "tuned"))
    saved = {p.name for p in (tmp_path / "tuned").iterdir()}
    assert ("adapter_config.json" in saved) == lora and ("config.json" in saved) != lora
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "tuned").eval()
    model.eval()
    ids = random_ids(2, 10, seed=41)
    with torch.no_grad():
        tuned, before = model(input_ids=ids).logits, AutoModelForCausalLM.from_pretrained(folder)(input_ids=ids).logits
        torch.testing.assert_close(reloaded(input_ids=ids).logits, tuned, rtol=1e-5, atol=1e-5)
    assert tuned.shape[-1] == VOCAB and not torch.allclose(tuned, before, atol=1e-3)  # the tuning is what loaded
