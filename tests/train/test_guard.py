"""A run a user can stop and trust: SIGINT/SIGTERM save the last step and resume bitwise, divergence stops with one
line, --out never writes into someone else's folder, pruning never removes the checkpoint just written, and the
same command resumes (configs compared resolved)."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch

from stemlm.checkpoint.folder import save_pretrained
from stemlm.checkpoint.safe_write import AtomicFolder
from stemlm.errors import StemlmError
from stemlm.model import build_model
from stemlm.train import Trainer
from stemlm.train.guard import check_run_dir
from stemlm.train.setup import RunRequest, requested_model
from stemlm.train.state import read_resumable_state
from tests.train.test_trainer import train_records


def signal_at(step, sig):
    def inject(s, loss):
        if s == step:
            os.kill(os.getpid(), sig)  # arrives mid-step, as a Ctrl-C would
        return loss

    return inject


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_saves_last_step_and_resume_is_bitwise(tmp_path, make_train_config, make_model_config, sig, capsys):
    kw = dict(steps=8, eval_every=0)
    full = Trainer(make_model_config("stem"), make_train_config(tmp_path / "a", **kw), progress=False)
    full.fit()
    stopped = Trainer(
        make_model_config("stem"),
        make_train_config(tmp_path / "b", **kw),
        fault_injection=signal_at(4, sig),
        progress=False,
    )
    result = stopped.fit()
    run = tmp_path / "b" / "run"
    assert result["stopped_by"] == signal.Signals(sig).name and result["steps"] == 4
    assert result["checkpoint"].endswith("step-000004") and (run / "loss.png").is_file()
    assert [r["step"] for r in train_records(run)] == [1, 2, 3, 4]
    assert f"--resume {run}" in capsys.readouterr().err
    assert signal.getsignal(sig) is not stopped  # handlers restored after fit
    resumed = Trainer.resume(run, progress=False)
    resumed.fit()
    assert [r["loss"] for r in train_records(run)] == [r["loss"] for r in train_records(tmp_path / "a" / "run")]
    for a, b in zip(full.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_divergence_stops_with_one_line(tmp_path, make_train_config, make_model_config):
    poison = lambda s, loss: loss * float("nan") if s >= 3 else loss  # noqa: E731
    cfg = make_train_config(tmp_path, steps=20, eval_every=0, max_skipped=4)
    trainer = Trainer(make_model_config("stem"), cfg, fault_injection=poison, progress=False)
    with pytest.raises(StemlmError, match=r"diverged: 4 consecutive .* step 6 \(lr .*last finite loss \d"):
        trainer.fit()
    records = train_records(tmp_path / "run")
    assert [r["step"] for r in records if r["spike"]] == [3, 4, 5, 6]  # non-finite jumps count as spikes


def test_out_must_not_be_a_checkpoint_or_a_foreign_folder(tmp_path, make_train_config, make_model_config):
    ckpt = save_pretrained(build_model(make_model_config("stem")), tmp_path / "ck")
    with pytest.raises(StemlmError, match="model checkpoint folder"):
        Trainer(make_model_config("stem"), make_train_config(tmp_path, out=str(ckpt), init_from=str(ckpt)))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "metrics.jsonl").write_text("mine\n")
    (mine / "thesis.tex").write_text("x")
    with pytest.raises(StemlmError, match="not a stemlm run .*thesis.tex"):
        Trainer(make_model_config("stem"), make_train_config(tmp_path, out=str(mine)))
    assert (mine / "metrics.jsonl").read_text() == "mine\n" and not (mine / "run_config.json").exists()


def test_stemlm_outputs_in_a_run_folder_are_the_runs_own(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-000007").mkdir(parents=True)
    with AtomicFolder(run / "analysis", producer="stemlm analyze") as tmp:
        (tmp / "analysis.json").write_text("{}")
    with pytest.raises(StemlmError, match=r"already has checkpoints; continue it with --resume .*newest: step 7"):
        check_run_dir(run)  # no readable trainer state: the step alone
    state = {"step": 7, "config": {"train": {"steps": 10}}}
    (run / "checkpoints" / "step-000007" / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(StemlmError, match=r"--resume \S+ \(it stopped at step 7 of 10\) or choose another --out"):
        check_run_dir(run)
    (run / "notes").mkdir()
    (run / "notes" / "stemlm-manifest.json").write_text("not a manifest")
    with pytest.raises(StemlmError, match="not a stemlm run .*notes"):
        check_run_dir(run)  # only a folder whose manifest names a stemlm producer counts as stemlm's
    shutil.rmtree(run / "notes")
    shutil.rmtree(run / "checkpoints")
    with pytest.raises(StemlmError, match=r"holds stemlm outputs \(analysis\) but no checkpoint"):
        check_run_dir(run)


def test_prune_keeps_the_checkpoint_just_written(tmp_path, make_train_config, make_model_config):
    cfg = make_train_config(tmp_path, steps=10, save_every=2, keep_last=1, eval_every=0)
    Trainer(make_model_config("stem"), cfg, progress=False).fit()
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / ".latest.json.tmp-999").write_text("{")  # a pointer's temp file left by a kill
    step10 = ckpts / "step-000010"
    assert sorted(p.name for p in ckpts.iterdir()) == [".latest.json.tmp-999", "latest.json", "step-000010"]
    # Resume from an older step (re-created here): the step-4 save must survive although step-10 is newer.
    Trainer(make_model_config("stem"), make_train_config(tmp_path / "x", steps=2, eval_every=0), progress=False).fit()
    os.rename(tmp_path / "x" / "run" / "checkpoints" / "step-000002", ckpts / "step-000002")
    resumed = Trainer.resume(ckpts / "step-000002", overrides={"steps": 4, "keep_last": 1}, progress=False)
    resumed.fit()
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest.json", "step-000004", "step-000010"]
    assert json.loads((ckpts / "latest.json").read_text())["path"] == "step-000004" and step10.is_dir()


def test_same_command_resumes_and_a_real_difference_is_named(tmp_path, make_train_config, make_model_config):
    Trainer(make_model_config("stem"), make_train_config(tmp_path, steps=3, eval_every=0), progress=False).fit()
    run = tmp_path / "run"
    # head_dim None (as a preset says) against the checkpoint's resolved 16: the same model.
    assert make_model_config("stem").head_dim is None
    Trainer.resume(run, model_config=make_model_config("stem"), overrides={"steps": 4}, progress=False).fit()
    with pytest.raises(StemlmError, match="hidden_size: run 64, requested 96"):
        Trainer.resume(run, model_config=make_model_config("stem", hidden_size=96), overrides={"steps": 5})


def test_hand_edited_trainer_state_is_one_line(tmp_path, make_train_config, make_model_config):
    Trainer(make_model_config("stem"), make_train_config(tmp_path, steps=2, eval_every=0), progress=False).fit()
    ckpt = tmp_path / "run" / "checkpoints" / "step-000002"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    (ckpt / "trainer_state.json").write_text(json.dumps({**state, "loss_spikes": "many"}))
    with pytest.raises(StemlmError, match="'loss_spikes' must be a non-negative integer"):
        read_resumable_state(ckpt)
    with pytest.raises(StemlmError, match="edited or damaged"):
        Trainer.resume(tmp_path / "run", overrides={"steps": 4})


def test_stem_layers_validated_against_the_final_config():
    request = RunRequest(preset="tiny", ffn_layers="5", model_sets=["model.num_hidden_layers=6"])
    config, _ = requested_model(request, None)
    assert config.num_hidden_layers == 6 and config.special_layers == [5]
