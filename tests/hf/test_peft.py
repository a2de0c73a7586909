"""PEFT on a STEM model through `StemlmForCausalLM` (issue 24 point 3): LoRA on attention and the gate/down
projections, the STEM tables trained whole through `modules_to_save`, a falling loss, an adapter that saves and
reloads onto a fresh copy of the base, and `merge_and_unload()` giving the adapted logits."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from tests.hf.test_hf import random_ids, saved_stemlm, tiny_config

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]


@pytest.mark.parametrize("tables", [False, True])
def test_lora_trains_saves_reloads_and_merges(tmp_path, tables):
    _, folder = saved_stemlm(tmp_path, tiny_config("stem"))
    base = AutoModelForCausalLM.from_pretrained(folder)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=TARGETS, modules_to_save=["stem_embedding"] if tables else None
    )
    model = get_peft_model(base, config)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or (tables and "stem_embedding" in n) for n in trainable)
    assert any("mlp.gate_proj.lora_A" in n for n in trainable) and any("self_attn.q_proj" in n for n in trainable)
    assert tables == any("stem_embedding" in n for n in trainable)

    ids = random_ids(4, 12, seed=30)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(12):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses

    model.eval()
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "adapter")
    fresh = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        plain = fresh(input_ids=ids).logits
    assert not torch.allclose(plain, adapted, atol=1e-3)  # the adapter changes the model
    reloaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, adapted)
        merged = reloaded.merge_and_unload()
        assert type(merged).__name__ == "StemlmForCausalLM"
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted, rtol=1e-5, atol=1e-5)
