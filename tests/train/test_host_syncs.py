"""Device->host syncs per training step: reading a tensor's value (`Tensor.item` / `Tensor.tolist`, which on a GPU
wait for the device) happens twice per step (the losses with their finiteness, the gradient norm), never per
micro-batch. (MoE layers also read their per-expert token counts once per layer per micro-batch: the
dispatch sizes of `stemlm.model.experts.Experts`.) The 2-rank version is in tests/train/parallel/test_train_dist.py: per
micro-batch 2 collectives (the table rows and their gradients, planned on the host) and no read; per step 3 of
each.

Run: `OMP_NUM_THREADS=1 python -m pytest tests/train/test_host_syncs.py -q`.
"""

from __future__ import annotations

import pytest
import torch

from stemlm.train.trainer import Trainer


def count_reads(monkeypatch, trainer: Trainer) -> int:
    # torch's non-fused AdamW keeps each parameter's step counter as a host tensor and reads it with .item() (no
    # device involved, even on a GPU): those reads are not syncs. Every other read of a value is counted.
    host_counters = {id(state["step"]) for opt in trainer.optimizers for state in opt.state.values() if "step" in state}
    calls = {"n": 0}
    for name in ("item", "tolist"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            calls["n"] += id(self) not in host_counters
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    trainer.train_step()
    monkeypatch.undo()
    return calls["n"]


@pytest.mark.parametrize("ffn", ["stem", "dense"])
def test_reads_per_step_do_not_grow_with_micro_batches(
    tmp_path, monkeypatch, make_train_config, make_model_config, ffn
):
    counts = {}
    for accum in (1, 4):
        cfg = make_train_config(tmp_path / str(accum), grad_accum=accum, steps=3, eval_every=0)
        trainer = Trainer(make_model_config(ffn), cfg, progress=False)
        trainer.train_step()  # the first step may set up state; count a steady-state one
        counts[accum] = count_reads(monkeypatch, trainer)
    # One read of the step's losses and their finiteness, one of the clipped gradient norm.
    assert counts == {1: 2, 4: 2}


def test_a_nan_micro_batch_still_skips_the_step(tmp_path, make_train_config, make_model_config):
    cfg = make_train_config(tmp_path, grad_accum=3, steps=2, eval_every=0)
    poison = lambda step, loss: loss * float("nan") if step == 1 else loss  # noqa: E731
    trainer = Trainer(make_model_config("stem"), cfg, fault_injection=poison, progress=False)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    record = trainer.train_step()
    assert record["skipped"] and trainer.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    assert all(p.grad is None for p in trainer.model.parameters())
    assert not trainer.train_step()["skipped"]
