"""The prefetching loader (`stemlm.train.prefetch`) and per-epoch sampling of text data, in the trainer.

Checked: a prefetcher returns exactly the batches the sampler gives (read ahead on its worker thread, never past
the run's end, any window on demand); the CUDA branch (pinned copies made on the worker, non_blocking moves) runs
on CPU with `pin_memory` stood in; a run with prefetching equals one without bitwise, and so does a run resumed
from a crash with per-epoch text sampling.

    OMP_NUM_THREADS=1 python -m pytest tests/train/test_prefetch.py -q
"""

from __future__ import annotations

import threading

import pytest
import torch

from stemlm.train import Trainer
from stemlm.train.prefetch import BatchPrefetcher


def make_sampler(log: list[tuple[int, str]]):
    def sample(window: int):
        log.append((window, threading.current_thread().name))
        x = torch.arange(6).reshape(2, 3) + 100 * window
        return x, x + 1

    return sample


def test_prefetcher_reads_ahead_on_its_thread_and_returns_the_sampled_batches():
    log: list[tuple[int, str]] = []
    batches = BatchPrefetcher(make_sampler(log), torch.device("cpu"), ahead=2, end=6)
    try:
        for window in range(6):
            x, y = batches.get(window)
            assert torch.equal(x, torch.arange(6).reshape(2, 3) + 100 * window) and torch.equal(y, x + 1)
    finally:
        batches.close()
    read = [w for w, _ in log]
    assert sorted(read) == list(range(6))  # each window once, none at or past the end
    assert all(name.startswith("stemlm-prefetch") for w, name in log if w > 0)  # read ahead, off the main thread
    assert batches.pool is None


def test_prefetcher_serves_any_window_and_drops_what_is_no_longer_wanted():
    log: list[tuple[int, str]] = []
    batches = BatchPrefetcher(make_sampler(log), torch.device("cpu"), ahead=2)
    try:
        batches.get(0)
        x, _ = batches.get(7)  # a jump (e.g. a resume): read on the spot
        assert int(x[0, 0]) == 700
        assert not any(w < 7 for w in batches.pending)  # windows 1 and 2 were dropped
        assert sorted(batches.pending) == [8, 9]
        again = BatchPrefetcher(make_sampler(log), torch.device("cpu"), ahead=0)
        assert int(again.get(3)[0][0, 0]) == 300 and again.pool is None  # ahead 0: read in the step
    finally:
        batches.close()


def test_cuda_branch_pins_on_the_worker_and_moves_non_blocking(monkeypatch):
    # pin_memory needs CUDA; standing in for it runs the same code as on a GPU: the worker pins, get() moves.
    pinned_on: list[str] = []
    moved: list[bool] = []

    def fake_pin(self):
        pinned_on.append(threading.current_thread().name)
        return self.clone()

    real_to = torch.Tensor.to

    def spy_to(self, *args, **kwargs):
        moved.append(kwargs.get("non_blocking", False))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    log: list[tuple[int, str]] = []
    batches = BatchPrefetcher(make_sampler(log), torch.device("cpu"), ahead=1, end=3)
    batches.pin = True
    monkeypatch.setattr(torch.Tensor, "to", spy_to)
    try:
        outs = [batches.get(w)[0] for w in range(3)]
    finally:
        batches.close()
    assert [int(x[0, 0]) for x in outs] == [0, 100, 200]
    assert len(pinned_on) == 6 and sum(n.startswith("stemlm-prefetch") for n in pinned_on) == 4  # windows 1, 2
    assert moved == [True] * 6


@pytest.mark.parametrize("prefetch", [0, 3])
def test_prefetching_changes_no_number(tmp_path, make_train_config, make_model_config, prefetch):
    model_config = make_model_config("stem")
    kw = dict(steps=5, eval_every=0, grad_accum=2)
    ref = Trainer(model_config, make_train_config(tmp_path / "a", prefetch=1, **kw), progress=False)
    ref.fit()
    other = Trainer(model_config, make_train_config(tmp_path / "b", prefetch=prefetch, **kw), progress=False)
    other.fit()
    assert other.batches.prefetcher is None  # closed at the end of fit
    for a, b in zip(ref.model.parameters(), other.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_epoch_sampling_of_text_resumes_bitwise(tmp_path, make_train_config, make_model_config):
    from tests.train.test_trainer import crash_at, train_records

    model_config = make_model_config("stem")
    kw = dict(steps=8, save_every=3, keep_last=5, eval_every=0, sampling="epoch")
    full = Trainer(model_config, make_train_config(tmp_path / "a", **kw), progress=False)
    assert full.train_data.sampling == "epoch" and full.run_config()["resolved"]["sampling"] == "epoch"
    full.fit()
    crashed = Trainer(
        model_config, make_train_config(tmp_path / "b", **kw), fault_injection=crash_at(5), progress=False
    )
    with pytest.raises(Exception, match="simulated crash"):
        crashed.fit()
    resumed = Trainer.resume(tmp_path / "b" / "run", progress=False)
    assert resumed.step == 3 and resumed.train_data.sampling == "epoch"
    resumed.fit()
    reference, again = train_records(tmp_path / "a" / "run"), train_records(tmp_path / "b" / "run")
    assert [r["loss"] for r in again] == [r["loss"] for r in reference]
    for a, b in zip(full.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_text_sampling_defaults_to_uniform(tmp_path, make_train_config, make_model_config):
    trainer = Trainer(make_model_config("stem"), make_train_config(tmp_path, steps=1), progress=False)
    assert trainer.train_data.sampling == "uniform"  # auto: the published figures' sampling
    assert trainer.run_config()["resolved"]["sampling"] == "uniform"
