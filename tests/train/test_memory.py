"""Memory levers in the trainer: activation checkpointing trains bitwise the same model with the same parameter
names; the chunked loss, checkpointed or fused, matches the full-logits loss to 1e-6 over a short run.

Run: `OMP_NUM_THREADS=1 python -m pytest tests/train/test_memory.py -q`.
"""

from __future__ import annotations

import pytest
import torch

from stemlm.train.trainer import Trainer
from tests.train.test_trainer import train_records


@pytest.mark.parametrize("ffn", ["stem", "moe"])
def test_activation_checkpointing_is_bitwise_and_keeps_names(tmp_path, make_train_config, make_model_config, ffn):
    kw = dict(steps=3, eval_every=0)
    plain = Trainer(make_model_config(ffn), make_train_config(tmp_path / "a", **kw), progress=False)
    plain.fit()
    ckpt = Trainer(
        make_model_config(ffn), make_train_config(tmp_path / "b", activation_checkpointing=True, **kw), progress=False
    )
    ckpt.fit()
    assert [n for n, _ in ckpt.model.named_parameters()] == [n for n, _ in plain.model.named_parameters()]
    assert [r["loss"] for r in train_records(tmp_path / "b" / "run")] == [
        r["loss"] for r in train_records(tmp_path / "a" / "run")
    ]
    assert all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), ckpt.model.parameters(), strict=True))


@pytest.mark.parametrize("fused", [False, True])
def test_chunked_loss_run_matches(tmp_path, make_train_config, make_model_config, fused):
    # Adam moves a weight by lr * g / (sqrt(v) + eps): a gradient entry that is summation noise (~1e-11, its sign
    # set by the summation order the chunks change) would move by up to lr with eps 1e-8; eps 1e-6 bounds that
    # below the 1e-6 compared here (as in tests/train/parallel/conftest.py). The fused loss also rounds its
    # softmax differently (exp / sum, not exp of the log-softmax): ~1e-9 on a gradient entry, which eps 1e-6
    # would let move a weight by 3 steps x lr x 1e-9 / eps ~ 1e-5 (1.8e-6 seen), so it runs at eps 1e-5.
    kw = dict(steps=3, eval_every=0, eps=1e-5 if fused else 1e-6)
    plain = Trainer(make_model_config("stem"), make_train_config(tmp_path / "a", **kw), progress=False)
    plain.fit()
    chunked_cfg = make_train_config(tmp_path / "b", loss_chunk=40, fused_loss=fused, **kw)
    chunked = Trainer(make_model_config("stem"), chunked_cfg, progress=False)
    chunked.fit()
    a, b = train_records(tmp_path / "a" / "run"), train_records(tmp_path / "b" / "run")
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-6, abs=1e-6)
    for x, y in zip(plain.model.parameters(), chunked.model.parameters(), strict=True):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)


def test_fused_loss_evaluates_too(tmp_path, make_train_config, make_model_config, monkeypatch):
    import dataclasses

    from stemlm.model import decoder
    from stemlm.model.fused_loss import fused_linear_cross_entropy

    trainer = Trainer(make_model_config("stem"), make_train_config(tmp_path, steps=2, eval_every=0), progress=False)
    trainer.fit()
    full = trainer.evaluate()
    calls = []
    monkeypatch.setattr(
        decoder, "fused_linear_cross_entropy", lambda *a: calls.append(1) or fused_linear_cross_entropy(*a)
    )
    trainer.cfg = dataclasses.replace(trainer.cfg, loss_chunk=40, fused_loss=True)
    assert trainer.evaluate() == pytest.approx(full, rel=1e-6) and calls  # the held-out loss, through the fused path


def test_cli_flags_reach_the_config(tmp_path, train_assets, capsys):
    import json

    from tests.train.test_cli import MODEL, run_cli

    args = ["train", "--data", str(train_assets["data"]), "--tokenizer", str(train_assets["tokenizer"]),
            "--steps", "1", "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1", "--threads", "1",
            "--no-progress", "--sample-tokens", "0", "--out", str(tmp_path / "run"), "--set", *MODEL,
            "--activation-checkpointing", "--loss-chunk", "16", "--set", "train.fused_loss=true"]  # fmt: skip
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    train = json.loads((tmp_path / "run" / "run_config.json").read_text())["train"]
    assert train["activation_checkpointing"] is True and train["loss_chunk"] == 16 and train["fused_loss"] is True


def test_fused_loss_needs_a_chunk(tmp_path, make_train_config):
    from stemlm.errors import StemlmError

    with pytest.raises(StemlmError, match="fused_loss needs loss_chunk > 0"):
        make_train_config(tmp_path, fused_loss=True).validate()


@pytest.mark.parametrize(
    "vocab, given, expected",
    [
        (8192, {}, (False, 0)),  # the default run: the plain path, bitwise as before
        (65535, {"loss_chunk": 64}, (False, 64)),  # the chunked, checkpointed path the flag asks for
        (65536, {}, (True, 512)),  # from the threshold up: fused, with the default chunk
        (131072, {"loss_chunk": 1024}, (True, 1024)),
        (131072, {"fused_loss": False}, (False, 0)),  # an explicit choice is kept
        (8192, {"fused_loss": True, "loss_chunk": 8}, (True, 8)),
    ],
)
def test_the_loss_path_is_chosen_by_the_vocabulary(
    tmp_path, make_train_config, make_model_config, vocab, given, expected
):
    from stemlm.train.memory import resolve_loss

    cfg = resolve_loss(make_train_config(tmp_path, **given), make_model_config("stem").replace(vocab_size=vocab))
    assert (cfg.fused_loss, cfg.loss_chunk) == expected


def test_a_large_vocabulary_trains_through_the_fused_loss_and_records_it(
    tmp_path, make_train_config, make_model_config, monkeypatch
):
    import json

    from stemlm.model import decoder
    from stemlm.model.fused_loss import fused_linear_cross_entropy

    calls = []
    monkeypatch.setattr(
        decoder, "fused_linear_cross_entropy", lambda *a: calls.append(1) or fused_linear_cross_entropy(*a)
    )
    config = make_model_config("stem").replace(vocab_size=65536)
    Trainer(config, make_train_config(tmp_path, steps=1, eval_every=0), progress=False).fit()
    train = json.loads((tmp_path / "run" / "run_config.json").read_text())["train"]
    assert calls and (train["fused_loss"], train["loss_chunk"]) == (True, 512)
