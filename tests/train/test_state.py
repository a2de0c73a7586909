"""Trainer checkpoints: RNG capture/restore, optimizer state round trip, pruning, the latest pointer, and
atomicity when a save is interrupted mid-write.

Run: `OMP_NUM_THREADS=1 python -m pytest tests/train/test_state.py -q`.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from stemlm.checkpoint.folder import save_pretrained
from stemlm.checkpoint.runs import from_pretrained, resolve_checkpoint
from stemlm.data import load_tokenizer
from stemlm.errors import StemlmError
from stemlm.model import build_model
from stemlm.train import state as state_mod
from stemlm.train.config import TrainConfig
from stemlm.train.optim import build_optimizers
from stemlm.train.state import (
    capture_rng,
    checkpoint_dir,
    load_optimizer_state,
    read_trainer_state,
    restore_rng,
    save_checkpoint,
)


def draws():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist(), float(np.random.randn())


def test_rng_round_trip_through_json():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.randn()  # leaves a cached gaussian in numpy's legacy state
    saved = json.loads(json.dumps(capture_rng()))
    first = draws()
    restore_rng(saved)
    assert draws() == first


def trained(make_model_config, seed=0):
    model = build_model(make_model_config("stem"), seed=seed)
    opts = build_optimizers(model, TrainConfig(table_optim="adamw"))  # dense: the random gradients below are dense
    gen = torch.Generator().manual_seed(seed)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return model, opts


@pytest.fixture
def tokenizer(train_assets):
    return load_tokenizer(train_assets["tokenizer"])


def test_checkpoint_round_trip(tmp_path, make_model_config, tokenizer):
    model, opts = trained(make_model_config)
    path = save_checkpoint(tmp_path, 7, model, tokenizer, opts, {"skipped_steps": 1}, keep_last=2)
    assert path == checkpoint_dir(tmp_path, 7) == tmp_path / "checkpoints" / "step-000007"
    state, tensors = read_trainer_state(path)
    assert state["step"] == 7 and state["skipped_steps"] == 1
    assert all(k.startswith(("opt0.state.", "opt1.state.")) for k in tensors)
    # A fresh model and optimizers take the saved moments; the weights come back through the model format.
    loaded = from_pretrained(path)
    for a, b in zip(loaded.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    _, fresh = trained(make_model_config, seed=1)
    load_optimizer_state(fresh, tensors, state["optimizers"], path)
    for old, new in zip(opts, fresh, strict=True):
        params_old = [p for g in old.param_groups for p in g["params"]]
        params_new = [p for g in new.param_groups for p in g["params"]]
        for p_old, p_new in zip(params_old, params_new, strict=True):
            s_old, s_new = old.state[p_old], new.state[p_new]
            assert s_old.keys() == s_new.keys() and s_old
            assert all(torch.equal(s_old[k], s_new[k]) for k in s_old)


def test_optimizer_kind_mismatch_is_named(tmp_path, make_model_config, tokenizer):
    model, opts = trained(make_model_config)
    path = save_checkpoint(tmp_path, 1, model, tokenizer, opts, {}, keep_last=1)
    state, tensors = read_trainer_state(path)
    lazy = build_optimizers(build_model(make_model_config("stem")), TrainConfig(table_optim="lazy_adamw"))
    with pytest.raises(StemlmError, match="optimizer 1 was DenseAdamW, this run builds LazyAdamW"):
        load_optimizer_state(lazy, tensors, state["optimizers"], path)


def test_keep_last_and_latest_pointer(tmp_path, make_model_config, tokenizer):
    model, opts = trained(make_model_config)
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, model, tokenizer, opts, {}, keep_last=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest.json", "step-000003", "step-000004"]
    assert json.loads((tmp_path / "checkpoints" / "latest.json").read_text()) == {"step": 4, "path": "step-000004"}
    assert resolve_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 4)


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), RuntimeError("killed")])
@pytest.mark.parametrize("same_step", [False, True])
def test_interrupted_save_keeps_previous_checkpoint(
    tmp_path, make_model_config, tokenizer, monkeypatch, error, same_step
):
    model, opts = trained(make_model_config)
    good = save_checkpoint(tmp_path, 2, model, tokenizer, opts, {"marker": "good"}, keep_last=3)
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    def fail(*args, **kwargs):  # the model files are already in the temp folder when this raises
        raise error

    monkeypatch.setattr(state_mod, "save_file", fail)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with pytest.raises(StemlmError if isinstance(error, OSError) else RuntimeError):
        save_checkpoint(tmp_path, 2 if same_step else 3, model, tokenizer, opts, {"marker": "bad"}, keep_last=3)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest.json", "step-000002"]
    assert resolve_checkpoint(tmp_path) == good
    assert read_trainer_state(good)[0]["marker"] == "good"
    reloaded = from_pretrained(good).state_dict()
    assert all(torch.equal(reloaded[k], weights[k]) for k in reloaded)


def test_model_only_checkpoint_is_not_resumable(tmp_path, make_model_config):
    save_pretrained(build_model(make_model_config("dense")), tmp_path / "m")
    with pytest.raises(StemlmError, match="not a trainer checkpoint.*--init-from"):
        read_trainer_state(tmp_path / "m")


def test_cuda_rng_is_saved_and_restored_per_local_device(monkeypatch):
    """Simulated CUDA (no GPU here): the current device's state is saved alone, and an older checkpoint with one
    state per device restores into a process that sees fewer devices without an IndexError."""
    import base64

    from stemlm.train import state as state_mod

    states = {0: torch.arange(16, dtype=torch.uint8), 1: torch.arange(16, 32, dtype=torch.uint8)}
    current, restored = {"index": 1}, {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["index"])
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": states[current["index"]])
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device="cuda": restored.update({current["index"]: s}))
    saved = state_mod.capture_rng()
    assert saved["cuda"] == [base64.b64encode(bytes(range(16, 32))).decode("ascii")]
    current["index"] = 0
    state_mod.restore_rng(saved)
    assert restored[0].tolist() == list(range(16, 32))
    old = {**saved, "cuda": [base64.b64encode(bytes([k] * 16)).decode("ascii") for k in range(8)]}  # 8 GPUs
    current["index"] = 3
    state_mod.restore_rng(old)
    assert restored[3].tolist() == [3] * 16
