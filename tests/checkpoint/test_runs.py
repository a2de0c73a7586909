"""Tests of `stemlm.checkpoint.runs`: a CKPT argument as a checkpoint folder or a run folder, and loading with a
tokenizer."""

from __future__ import annotations

import shutil

import pytest
import torch

from stemlm.checkpoint.folder import save_pretrained
from stemlm.checkpoint.runs import load_checkpoint, resolve_checkpoint, step_checkpoints
from stemlm.data.tokenizer import default_tokenizer
from stemlm.errors import StemlmError
from stemlm.model import build_model
from stemlm.model.config import ModelConfig

CONFIG = dict(
    vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2, ffn_layers=[1]
)


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig(**CONFIG), seed=0)


def _run(tmp_path, model, steps):
    run = tmp_path / "run"
    for step in steps:
        save_pretrained(model, run / "checkpoints" / f"step-{step:07d}")
    return run


def test_checkpoint_folder_resolves_to_itself(tmp_path, model):
    ckpt = save_pretrained(model, tmp_path / "ckpt")
    assert resolve_checkpoint(ckpt) == ckpt


def test_run_folder_resolves_to_newest_complete_step(tmp_path, model):
    run = _run(tmp_path, model, [10, 200, 30])
    assert resolve_checkpoint(run) == run / "checkpoints" / "step-0000200"
    # An interrupted save (config written, weights missing) and stray folders are not candidates.
    broken = run / "checkpoints" / "step-0000300"
    shutil.copytree(run / "checkpoints" / "step-0000200", broken)
    (broken / "model.safetensors").unlink()
    (run / "checkpoints" / ".step-0000400.tmp-abc").mkdir()
    (run / "checkpoints" / "notes").mkdir()
    assert [s for s, _ in step_checkpoints(run)] == [10, 30, 200]
    assert resolve_checkpoint(run) == run / "checkpoints" / "step-0000200"


def test_trainer_pointer_is_followed_and_falls_back_when_unusable(tmp_path, model):
    from stemlm.train.state import checkpoint_dir, write_latest

    run = tmp_path / "run"
    for step in (100, 200, 150):  # resumed from 100 after 200 was written: 200 is a leftover of that branch
        save_pretrained(model, checkpoint_dir(run, step))
    write_latest(run, 150)
    assert resolve_checkpoint(run) == checkpoint_dir(run, 150)
    # The pointed-to folder lost its weights: fall back to the newest complete step.
    (checkpoint_dir(run, 150) / "model.safetensors").unlink()
    assert resolve_checkpoint(run) == checkpoint_dir(run, 200)
    for broken in ("{not json", '{"step": 7}', '["step-000100"]', '{"path": "step-999999"}'):
        (run / "checkpoints" / "latest.json").write_text(broken)
        assert resolve_checkpoint(run) == checkpoint_dir(run, 200), broken


def test_resolution_errors(tmp_path, model):
    with pytest.raises(StemlmError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nope")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(StemlmError, match="is a file"):
        resolve_checkpoint(tmp_path / "file.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(StemlmError, match="neither a checkpoint folder"):
        resolve_checkpoint(tmp_path / "empty")
    (tmp_path / "fresh" / "checkpoints").mkdir(parents=True)
    with pytest.raises(StemlmError, match="no complete checkpoint"):
        resolve_checkpoint(tmp_path / "fresh")


def test_load_checkpoint_from_run_gives_the_saved_weights(tmp_path, model):
    run = _run(tmp_path, model, [5])
    loaded, tokenizer = load_checkpoint(run)
    assert tokenizer is None
    assert not loaded.training
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_load_checkpoint_with_tokenizer(tmp_path):
    tok = default_tokenizer()
    big = build_model(ModelConfig(**{**CONFIG, "vocab_size": tok.get_vocab_size()}), seed=0)
    ckpt = save_pretrained(big, tmp_path / "ckpt", tokenizer=tok)
    _, loaded = load_checkpoint(ckpt)
    assert loaded.encode("hello world").ids == tok.encode("hello world").ids


def test_tokenizer_larger_than_model_vocab_is_refused(tmp_path, model):
    ckpt = save_pretrained(model, tmp_path / "ckpt")
    default_tokenizer().save(str(ckpt / "tokenizer.json"))  # 8192 tokens for a 64-token model
    with pytest.raises(StemlmError, match="8192 tokens but the model's vocab_size is 64"):
        load_checkpoint(ckpt)


def test_export_model_writes_a_plain_folder_and_refuses_its_source(tmp_path):
    from stemlm.checkpoint.folder import save_pretrained
    from stemlm.checkpoint.runs import export_model, from_pretrained
    from stemlm.model import build_model
    from tests.conftest import make_tiny_config

    model = build_model(make_tiny_config("stem"), seed=0)
    save_pretrained(model, tmp_path / "ckpt")
    summary = export_model(tmp_path / "ckpt", tmp_path / "out", force=False, producer="test export")
    assert summary["sharded"] is False and summary["parameters"] == model.num_parameters()
    assert from_pretrained(tmp_path / "out").num_parameters() == model.num_parameters()
    with pytest.raises(StemlmError):
        export_model(tmp_path / "ckpt", tmp_path / "ckpt", force=True, producer="test export")


def test_named_model_config_from_a_preset_or_a_folder(tmp_path):
    from stemlm.checkpoint.runs import named_model_config
    from stemlm.model.presets import get_preset

    name, config = named_model_config("tiny", ffn="moe", overrides=["hidden_size=128"])
    assert name == "tiny" and config == get_preset("tiny").replace(ffn="moe", hidden_size=128)
    save_pretrained(build_model(get_preset("tiny"), seed=0), tmp_path / "ckpt")
    name, config = named_model_config(path=str(tmp_path / "ckpt"))
    assert name == str(tmp_path / "ckpt") and config.hidden_size == get_preset("tiny").hidden_size


def test_verify_checkpoint_names_a_changed_file(tmp_path):
    from stemlm.checkpoint.runs import verify_checkpoint
    from stemlm.model.presets import get_preset

    folder = save_pretrained(build_model(get_preset("tiny"), seed=0), tmp_path / "ckpt")
    assert verify_checkpoint(folder)["ok"] and verify_checkpoint(folder)["folder"] == str(folder)
    (folder / "config.json").write_text((folder / "config.json").read_text() + " ")
    with pytest.raises(StemlmError, match="config.json \\(changed\\)"):
        verify_checkpoint(folder)


def test_checked_output_defaults_beside_the_checkpoint_and_refuses_files(tmp_path):
    from stemlm.checkpoint.runs import checked_output, output_dir
    from stemlm.model.presets import get_preset

    save_pretrained(build_model(get_preset("tiny"), seed=0), tmp_path / "ckpt")
    folder, guard = checked_output(None, str(tmp_path / "ckpt"), "analysis", "stemlm analyze", False)
    assert folder == output_dir(str(tmp_path / "ckpt"), "analysis")
    assert guard == {"producer": "stemlm analyze", "force": False, "sources": [str(tmp_path / "ckpt")]}
    nothing = {"producer": "stemlm cache-sim", "force": False, "sources": []}
    assert checked_output(None, None, "cache-sim", "stemlm cache-sim", False) == (None, nothing)
    (tmp_path / "file").write_text("x")
    with pytest.raises(StemlmError, match="is a file"):
        checked_output(str(tmp_path / "file"), None, "x", "stemlm x", False)
