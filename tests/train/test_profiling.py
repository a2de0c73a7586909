"""`--profile` / `--memory-snapshot`: the profiler records the steps it says, writes its traces and operator table
into RUN/profile, changes no number, and a snapshot is refused on a CPU before anything is written."""

import json

import pytest
import torch

from stemlm.cli.main import main
from stemlm.errors import StemlmError
from stemlm.train.guard import check_run_dir
from stemlm.train.logging import read_metrics
from stemlm.train.profiling import PROFILE_DIR, profile_schedule
from stemlm.train.trainer import Trainer


@pytest.mark.parametrize(
    "remaining, expected",
    [(20, (1, 1, 3)), (5, (1, 1, 3)), (4, (1, 1, 2)), (3, (1, 1, 1)), (2, (0, 1, 1)), (1, (0, 0, 1))],
)
def test_schedule_skips_the_first_step_and_records_at_least_one(remaining, expected):
    got = profile_schedule(remaining)
    assert (got["wait"], got["warmup"], got["active"]) == expected
    assert sum(expected) <= remaining


def _train_losses(run):
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]


def test_profiled_run_writes_traces_and_changes_nothing(tmp_path, make_train_config, make_model_config):
    plain = make_train_config(tmp_path / "plain", steps=6, eval_every=0)
    Trainer(make_model_config(), plain, progress=False).fit()
    profiled = make_train_config(tmp_path / "profiled", steps=6, eval_every=0, profile=True)
    Trainer(make_model_config(), profiled, progress=False).fit()
    assert _train_losses(tmp_path / "profiled" / "run") == _train_losses(tmp_path / "plain" / "run")  # bitwise
    folder = tmp_path / "profiled" / "run" / PROFILE_DIR
    traces = list(folder.glob("rank0*.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"}  # skip 1, warm up 1, record 3
    table = (folder / "summary-rank0.txt").read_text()
    assert "aten::mm" in table and "Self CPU" in table
    with pytest.raises(StemlmError, match="already has checkpoints"):  # not "not a stemlm run": RUN/profile is its own
        check_run_dir(folder.parent)
    assert not (tmp_path / "plain" / "run" / PROFILE_DIR).exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_memory_snapshot_needs_cuda_and_writes_nothing(tmp_path, make_train_config, make_model_config, capsys):
    cfg = make_train_config(tmp_path, memory_snapshot=True)
    with pytest.raises(StemlmError, match="needs a CUDA device"):
        Trainer(make_model_config(), cfg, progress=False)
    assert not (tmp_path / "run").exists()
    assert main(["train", "--memory-snapshot", "--device", "cpu", "--steps", "1", "--out", str(tmp_path / "r")]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err and not (tmp_path / "r").exists()
