"""The training loop: loss goes down, outputs are written, resume is bitwise exact, bad steps are skipped.

Every run is tiny (hidden 64, 2 layers, vocab 320, seq 32, batch 4) and takes about a second on one thread.
Run: `OMP_NUM_THREADS=1 python -m pytest tests/train/test_trainer.py -q`.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from stemlm.checkpoint.folder import save_pretrained
from stemlm.checkpoint.runs import from_pretrained
from stemlm.data import load_tokenizer
from stemlm.data.tokenizer import tokenizer_digest
from stemlm.errors import StemlmError
from stemlm.model import build_model
from stemlm.train.config import fit_vocab
from stemlm.train.logging import read_metrics
from stemlm.train.trainer import Trainer


def train_records(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]


@pytest.mark.parametrize("ffn", ["dense", "stem"])
def test_short_run_lowers_loss(tmp_path, make_train_config, make_model_config, ffn):
    result = Trainer(make_model_config(ffn), make_train_config(tmp_path), progress=False).fit()
    losses = [r["loss"] for r in train_records(tmp_path / "run")]
    assert len(losses) == 20 and result["steps"] == 20
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5
    evals = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [10, 20]
    assert evals[1]["heldout_loss"] < evals[0]["heldout_loss"] < math.log(320)
    assert result["heldout_loss"] == evals[1]["heldout_loss"]
    assert result["skipped_steps"] == 0 and result["tokens_seen"] == 20 * 4 * 32


def test_run_folder_outputs(tmp_path, make_train_config, make_model_config):
    Trainer(make_model_config("stem"), make_train_config(tmp_path, steps=6, eval_every=3), progress=False).fit()
    run = tmp_path / "run"
    config = json.loads((run / "run_config.json").read_text())
    assert config["model"]["hidden_size"] == 64 and config["train"]["steps"] == 6
    assert config["tokenizer"]["vocab_size"] == 320
    records = read_metrics(run / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in records if r["kind"] == "eval"] == [("eval", 3), ("eval", 6)]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 7))
    assert {"loss", "lr", "table_lr", "grad_norm", "tokens_per_s", "skipped", "spike"} <= set(train[0])
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    tb_loss = [e.value for e in events.Scalars("train/loss")]
    assert tb_loss == pytest.approx([r["loss"] for r in train], rel=1e-6)
    assert [e.step for e in events.Scalars("eval/heldout_loss")] == [3, 6]
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run / "checkpoints" / "step-000006" / "trainer_state.json").is_file()


class Crash(Exception):
    pass


def crash_at(step):
    def inject(s, loss):
        if s == step:
            raise Crash(f"simulated crash at step {s}")
        return loss

    return inject


@pytest.mark.parametrize("ffn, table_optim", [("stem", "adamw"), ("stem", "lazy_adamw"), ("moe", "adamw")])
def test_resume_after_crash_is_bitwise_identical(tmp_path, make_train_config, make_model_config, ffn, table_optim):
    model_config = make_model_config(ffn)
    kw = dict(steps=10, save_every=5, keep_last=5, eval_every=0, table_optim=table_optim)
    full = Trainer(model_config, make_train_config(tmp_path / "a", **kw), progress=False)
    full.fit()
    reference = train_records(tmp_path / "a" / "run")

    crashed = Trainer(
        model_config, make_train_config(tmp_path / "b", **kw), fault_injection=crash_at(7), progress=False
    )
    with pytest.raises(Crash):
        crashed.fit()
    assert [r["step"] for r in train_records(tmp_path / "b" / "run")] == list(range(1, 7))
    resumed = Trainer.resume(tmp_path / "b" / "run", progress=False)
    assert resumed.step == 5
    resumed.fit()
    again = train_records(tmp_path / "b" / "run")
    assert [r["step"] for r in again] == list(range(1, 11))
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in again] == [r[key] for r in reference]  # exact float equality, not approx
    events = EventAccumulator(str(tmp_path / "b" / "run" / "tensorboard"))
    events.Reload()  # step 6 was logged twice (before the crash and after resuming); TensorBoard keeps the second
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 11))
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([r["loss"] for r in reference], rel=1e-6)
    for a, b in zip(full.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_resume_from_a_chosen_checkpoint(tmp_path, make_train_config, make_model_config):
    kw = dict(steps=10, save_every=5, keep_last=5, eval_every=0, keep_optimizer_state="all")
    cfg = make_train_config(tmp_path, **kw)
    Trainer(make_model_config("stem"), cfg, progress=False).fit()
    reference = train_records(tmp_path / "run")
    Trainer.resume(tmp_path / "run" / "checkpoints" / "step-000005", progress=False).fit()
    again = train_records(tmp_path / "run")
    timing = ("tokens_per_s", "model_gflops_per_s")  # wall-clock figures differ between the two runs
    assert again == [{**r, **{k: s[k] for k in timing}} for r, s in zip(reference, again, strict=True)]


def test_only_the_newest_checkpoint_keeps_optimizer_state(tmp_path, make_train_config, make_model_config):
    cfg = make_train_config(tmp_path, steps=10, save_every=5, keep_last=5, eval_every=0)
    Trainer(make_model_config("stem"), cfg, progress=False).fit()
    ckpts = tmp_path / "run" / "checkpoints"
    assert not (ckpts / "step-000005" / "optimizer.safetensors").exists()
    assert (ckpts / "step-000010" / "optimizer.safetensors").is_file()
    assert from_pretrained(ckpts / "step-000005").num_parameters() > 0  # the older weights stay loadable
    with pytest.raises(StemlmError, match="holds no optimizer state.*keep_optimizer_state=all"):
        Trainer.resume(ckpts / "step-000005", progress=False)
    Trainer.resume(tmp_path / "run", overrides={"steps": 12}, progress=False).fit()  # the newest resumes
    assert not (ckpts / "step-000010" / "optimizer.safetensors").exists()
    assert (ckpts / "step-000012" / "optimizer.safetensors").is_file()


def snapshot(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_nan_loss_step_is_skipped_and_counted(tmp_path, make_train_config, make_model_config):
    def poison(step, loss):
        return loss * float("nan") if step in (3, 4) else loss

    def make(folder):
        cfg = make_train_config(tmp_path / folder, steps=8, eval_every=0)
        return Trainer(make_model_config("stem"), cfg, fault_injection=poison, progress=False)

    trainer = make("manual")
    trainer.train_step(), trainer.train_step()
    before = snapshot(trainer)
    steps_before = [s["step"].clone() for opt in trainer.optimizers for s in opt.state.values() if "step" in s]
    record = trainer.train_step()
    assert record["skipped"] and math.isnan(record["loss"])
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(trainer), strict=True))  # no update
    assert [s["step"] for opt in trainer.optimizers for s in opt.state.values() if "step" in s] == steps_before
    trainer.train_step()
    assert trainer.train_step()["skipped"] is False and trainer.skipped_steps == 2
    assert not all(torch.equal(a, b) for a, b in zip(before, snapshot(trainer), strict=True))

    result = make("fit").fit()
    assert result["skipped_steps"] == 2
    records = train_records(tmp_path / "fit" / "run")
    assert [r["step"] for r in records if r["skipped"]] == [3, 4]
    assert records[2]["loss"] is None  # non-finite numbers are written as null


class NanGrad(torch.autograd.Function):
    """Identity forward, NaN gradient: a finite loss whose backward poisons every gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def test_nan_gradient_step_is_skipped(tmp_path, make_train_config, make_model_config):
    trainer = Trainer(
        make_model_config("dense"),
        make_train_config(tmp_path, steps=4, eval_every=0),
        fault_injection=lambda s, loss: NanGrad.apply(loss) if s == 2 else loss,
        progress=False,
    )
    trainer.train_step()
    before = snapshot(trainer)
    record = trainer.train_step()
    assert math.isfinite(record["loss"]) and math.isnan(record["grad_norm"]) and record["skipped"]
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(trainer), strict=True))
    assert trainer.fit()["skipped_steps"] == 1


def test_loss_spikes_counted_once_window_is_full(tmp_path, make_train_config, make_model_config):
    trainer = Trainer(
        make_model_config("dense"),
        make_train_config(tmp_path, steps=10, eval_every=0, spike_window=5),
        fault_injection=lambda s, loss: loss * 3 if s in (3, 8) else loss,
        progress=False,
    )
    result = trainer.fit()
    records = train_records(tmp_path / "run")
    assert [r["step"] for r in records if r["spike"]] == [8]  # step 3 came before the window filled
    assert result["loss_spikes"] == 1 and result["skipped_steps"] == 0


def test_gradient_is_the_mean_over_micro_batches_plus_aux(tmp_path, make_train_config, make_model_config):
    cfg = make_train_config(tmp_path, steps=3, grad_accum=2, aux_loss_coef=0.5, eval_every=0)
    trainer = Trainer(make_model_config("moe"), cfg, progress=False)
    reference = copy.deepcopy(trainer.model)
    losses, auxes = [], []
    for k in range(2):  # step 0 uses the windows of data steps 0 and 1
        x, y = trainer.train_data.sample_batch(4, 32, seed=cfg.seed, step=k)
        out = reference(x, labels=y)
        ((out.loss + 0.5 * out.aux_loss) / 2).backward()
        losses.append(out.loss.item()), auxes.append(out.aux_loss.item())
    expected = math.sqrt(sum(float(p.grad.double().square().sum()) for p in reference.parameters()))
    record = trainer.train_step()
    assert record["grad_norm"] == pytest.approx(expected, rel=1e-5)
    assert record["loss"] == pytest.approx(sum(losses) / 2, rel=1e-6)
    assert record["aux_loss"] == pytest.approx(sum(auxes) / 2, rel=1e-6)


def test_bf16_autocast_keeps_fp32_weights(tmp_path, make_train_config, make_model_config):
    trainer = Trainer(make_model_config("stem"), make_train_config(tmp_path, steps=3, dtype="bf16"), progress=False)
    result = trainer.fit()
    assert result["autocast_dtype"] == "bfloat16" and math.isfinite(result["train_loss"])
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())


def test_init_from_checkpoint(tmp_path, make_train_config, make_model_config, train_assets):
    tok = load_tokenizer(train_assets["tokenizer"])
    start = build_model(make_model_config("stem"), seed=5)
    save_pretrained(start, tmp_path / "start", tokenizer=tok)
    cfg = make_train_config(tmp_path, steps=2, tokenizer=None, init_from=str(tmp_path / "start"), eval_every=0)
    trainer = Trainer(None, cfg, progress=False)
    assert tokenizer_digest(trainer.tokenizer) == tokenizer_digest(tok)
    assert all(torch.equal(a, b) for a, b in zip(start.parameters(), trainer.model.parameters(), strict=True))
    x, y = trainer.train_data.sample_batch(4, 32, seed=cfg.seed, step=0)
    with torch.no_grad():
        expected = start(x, labels=y).loss.item()
    assert trainer.train_step()["loss"] == expected
    with pytest.raises(StemlmError, match="hidden_size: run 64, requested 32"):
        Trainer(make_model_config("stem", hidden_size=32), cfg, progress=False)


def test_resume_checks_model_tokenizer_and_steps(tmp_path, make_train_config, make_model_config):
    config = make_model_config("stem")
    Trainer(config, make_train_config(tmp_path, steps=2, eval_every=0), progress=False).fit()
    run = tmp_path / "run"
    with pytest.raises(StemlmError, match=r"hidden_size: run 64, requested 32.*ffn_layers: run \[1\], requested \[0\]"):
        Trainer.resume(run, model_config=config.replace(hidden_size=32, ffn_layers="0"))
    from stemlm.data import default_tokenizer

    with pytest.raises(StemlmError, match="tokenizer differs from the run's"):
        Trainer.resume(run, tokenizer=default_tokenizer())
    with pytest.raises(StemlmError, match="already at step 2 of 2; pass a larger --steps"):
        Trainer.resume(run)
    with pytest.raises(StemlmError, match="already has checkpoints; continue it with --resume"):
        Trainer(config, make_train_config(tmp_path, steps=2), progress=False)
    result = Trainer.resume(run, overrides={"steps": 3}, progress=False).fit()
    assert result["steps"] == 3
    assert json.loads((run / "run_config.json").read_text())["train"]["steps"] == 3
    # A later resume starts from the config the checkpoint was written under (steps 3), plus its own overrides.
    with pytest.raises(StemlmError, match="already at step 3 of 3"):
        Trainer.resume(run)
    assert Trainer.resume(run, overrides={"steps": 4}, progress=False).fit()["steps"] == 4


def test_fit_vocab_pads_to_multiple_of_64(make_model_config, train_assets):
    tok = load_tokenizer(train_assets["tokenizer"])
    assert fit_vocab(make_model_config(vocab_size=8192), tok).vocab_size == 320
    from tokenizers import Tokenizer, models

    small = Tokenizer(models.WordLevel({f"w{i}": i for i in range(65)}, unk_token="w0"))
    assert fit_vocab(make_model_config(), small).vocab_size == 128
