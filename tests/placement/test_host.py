"""`--tables host`: tables and their optimizer in a separate host buffer train bitwise like resident tables.

Runs are tiny (hidden 64, 2 layers, vocab 320, seq 32, batch 4). Run:
`OMP_NUM_THREADS=1 python -m pytest tests/placement/test_host.py -q`.
"""

from __future__ import annotations

import pytest
import torch

from stemlm.errors import StemlmError
from stemlm.placement.host import AsyncTableOptimizer
from stemlm.train.logging import read_metrics
from stemlm.train.trainer import Trainer
from tests.train.test_trainer import Crash, crash_at


def records(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] in ("train", "eval")]


def same_run(a: Trainer, b: Trainer, run_a, run_b) -> None:
    ra, rb = records(run_a), records(run_b)
    assert len(ra) == len(rb)
    for x, y in zip(ra, rb, strict=True):
        for key in ("loss", "grad_norm", "heldout_loss"):
            assert x.get(key) == y.get(key)  # exact float equality
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("table_optim, grad_accum", [("lazy_adamw", 2), ("rowwise_adagrad", 1)])
def test_host_tables_train_bitwise_like_resident(
    tmp_path, make_train_config, make_model_config, table_optim, grad_accum
):
    kw = dict(steps=6, eval_every=3, table_optim=table_optim, grad_accum=grad_accum)
    resident = Trainer(make_model_config("stem"), make_train_config(tmp_path / "a", **kw), progress=False)
    resident.fit()
    host = Trainer(make_model_config("stem"), make_train_config(tmp_path / "b", tables="host", **kw), progress=False)
    result = host.fit()
    same_run(resident, host, tmp_path / "a" / "run", tmp_path / "b" / "run")
    # The tables really live in the host buffers the optimizer steps, not in a device copy.
    assert isinstance(host.optimizers[-1], AsyncTableOptimizer)
    for i, table in host.model.token_tables().items():
        assert table.weight is host.tables.params[i]
    # Device bytes saved: the table plus its optimizer state, counted here from the config.
    v, w = 320, 128
    state = 2 * v * w * 4 + v * 8 if table_optim == "lazy_adamw" else v * 4  # moments + per-row steps / row sums
    assert result["device_bytes_saved"] == v * w * 4 + state
    assert 0.0 <= result["host_overlap"] <= 1.0


def test_host_tables_resume_bitwise_and_across_placements(tmp_path, make_train_config, make_model_config):
    kw = dict(steps=8, save_every=4, keep_last=5, eval_every=0, table_optim="lazy_adamw")
    full = Trainer(make_model_config("stem"), make_train_config(tmp_path / "a", tables="host", **kw), progress=False)
    full.fit()
    # Crash a resident run after its step-4 checkpoint, then continue it with host tables (and vice versa).
    for name, first, then in (("b", "device", "host"), ("c", "host", "device")):
        crashed = Trainer(
            make_model_config("stem"),
            make_train_config(tmp_path / name, tables=first, **kw),
            fault_injection=crash_at(6),
            progress=False,
        )
        with pytest.raises(Crash):
            crashed.fit()
        resumed = Trainer.resume(tmp_path / name / "run", overrides={"tables": then}, progress=False)
        assert resumed.step == 4
        resumed.fit()
        losses = [r["loss"] for r in records(tmp_path / name / "run") if r["kind"] == "train"]
        assert losses == [r["loss"] for r in records(tmp_path / "a" / "run") if r["kind"] == "train"]
        for a, b in zip(full.model.state_dict().values(), resumed.model.state_dict().values(), strict=True):
            assert torch.equal(a, b)


def test_host_tables_reject_what_they_cannot_do(tmp_path, make_train_config, make_model_config):
    with pytest.raises(StemlmError, match="row-sparse table optimizer"):
        Trainer(make_model_config("stem"), make_train_config(tmp_path, tables="host", table_optim="adamw"))
    with pytest.raises(StemlmError, match="needs a model with token tables"):
        Trainer(make_model_config("dense"), make_train_config(tmp_path / "d", tables="host", table_optim="lazy_adamw"))
    with pytest.raises(StemlmError, match="tables must be one of device, host"):
        make_train_config(tmp_path, tables="gpu")


def test_a_skipped_step_matches_resident(tmp_path, make_train_config, make_model_config):
    poison = lambda step, loss: loss * float("nan") if step == 2 else loss  # noqa: E731
    kw = dict(steps=4, eval_every=2, table_optim="lazy_adamw", grad_accum=2)
    runs = {}
    for tables in ("device", "host"):
        cfg = make_train_config(tmp_path / tables, tables=tables, **kw)
        runs[tables] = Trainer(make_model_config("stem"), cfg, fault_injection=poison, progress=False)
        assert runs[tables].fit()["skipped_steps"] == 1
    same_run(runs["device"], runs["host"], tmp_path / "device" / "run", tmp_path / "host" / "run")
