"""Tests for the torchrun helpers, the failure line and the byte counter (single process; the 2-process path of
`init_distributed` runs in tests/placement/test_row_sharded.py).
Run: `python -m pytest tests/train/parallel/test_launch.py -q`.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from stemlm.errors import StemlmError
from stemlm.placement.comm import CommCounter, all_to_all_rows, exchange_counts
from stemlm.train.parallel.launch import init_distributed, local_batch_size, torchrun_command
from stemlm.train.parallel.workers import ConsoleFilter, failure_message, rank_errors


def test_local_batch_size_keeps_the_global_batch():
    assert local_batch_size(32, 4) == 8
    with pytest.raises(StemlmError, match="divisible by 3"):
        local_batch_size(32, 3)


def test_torchrun_command_reexecutes_this_interpreter():
    cmd = torchrun_command(2, ["train", "--preset", "tiny"])
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[3:] == ["--standalone", "--nproc-per-node=2", "-m", "stemlm.cli.main", "train", "--preset", "tiny"]
    with pytest.raises(StemlmError, match="at least 1"):
        torchrun_command(0, [])


def test_plain_process_is_a_world_of_one(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    info = init_distributed(device="cpu")
    assert (info.rank, info.world_size, info.backend, info.is_main) == (0, 1, None, True)


def test_counter_and_single_process_exchange():
    counter = CommCounter()
    x = torch.randn(5, 3)
    assert torch.equal(all_to_all_rows(x, [5], [5], counter=counter), x)
    assert exchange_counts(torch.tensor([5]), counter=counter).tolist() == [5]
    counter.record("rows", 40, 12)
    assert counter.pop_step() == {"table_bytes_sent": 40, "table_bytes_recv": 12, "table_bytes_sent/rows": 40}
    assert counter.pop_step() == {"table_bytes_sent": 0, "table_bytes_recv": 0}
    assert (counter.total_sent, counter.total_recv) == (40, 12)


def test_multi_node_command_uses_a_rendezvous():
    cmd = torchrun_command(8, ["train"], nnodes=4, rdzv_endpoint="node0:29500")
    assert "--standalone" not in cmd
    assert cmd[3:8] == ["--nnodes=4", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29500", "--rdzv-id=stemlm",
                        "--nproc-per-node=8"]  # fmt: skip
    with pytest.raises(StemlmError, match="needs --rdzv-endpoint"):
        torchrun_command(8, ["train"], nnodes=2)


def test_slurm_tasks_become_ranks(monkeypatch):
    from stemlm.train.parallel.launch import adopt_slurm_env
    from stemlm.train.parallel.workers import distributed_worker

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")  # recorded, so the variables adopt_slurm_env sets are removed afterwards
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_NTASKS", "16")
    monkeypatch.setenv("SLURM_PROCID", "9")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "8(x2)")
    with pytest.raises(StemlmError, match="no MASTER_ADDR / MASTER_PORT"):
        adopt_slurm_env()
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert distributed_worker()
    assert [os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")] == ["9", "16", "1", "8"]


TORCHRUN_TAIL = """Root Cause (first observed failure):
[0]:
  time      : 2026-11-29_11:17:43
  rank      : 1 (local_rank: 1)
  exitcode  : {code} (pid: 8407) {signal}
  error_file: <N/A>
"""


def test_failure_line_names_the_rank_and_how_to_continue():
    line = failure_message(TORCHRUN_TAIL.format(code=1, signal=""), 1, 2, "runs/x", "runs/x/launch.log", True)
    assert "rank 1 of 2 exited with code 1;" in line and line.endswith("stemlm train --resume runs/x --nproc 2")
    assert "full log: runs/x/launch.log" in line
    assert "rank 1 of 2 exited with code -9 (killed by signal 9)" in failure_message(
        TORCHRUN_TAIL.format(code=-9, signal="(SIGKILL)"), 1, 2, "runs/x", "log", True
    )
    assert "torchrun exited with code 1;" in failure_message("no summary", 1, 2, "runs/x", "log", True)
    # No checkpoint yet: nothing to resume, so no advice to.
    assert "--resume" not in failure_message("no summary", 1, 2, "runs/x", "log", False)


def test_failure_line_is_the_first_failing_ranks_own_error():
    tail = (
        "stemlm train: error: [rank 1] data is bad\x20stemlm train: error: [rank 0] data is bad\n"
        + TORCHRUN_TAIL.format(code=2, signal="")
    )
    assert rank_errors(tail) == {0: "data is bad", 1: "data is bad"}
    line = failure_message(tail, 2, 2, "runs/x", "runs/x/launch.log", False)
    assert line == "data is bad (rank 1 of 2; full log: runs/x/launch.log)"  # rank 1 failed first
    no_summary = failure_message("stemlm train: error: [rank 0] bad\n", 2, 2, "r", "log", False)
    assert no_summary == "bad (rank 0 of 2; full log: log)"
    # The rank that failed first printed nothing (killed): another rank's error is only a consequence.
    tail = "stemlm train: error: [rank 0] Connection reset by peer\n" + TORCHRUN_TAIL.format(code=-9, signal="")
    assert "rank 1 of 2 exited with code -9" in failure_message(tail, 1, 2, "r", "log", False)


def test_console_shows_the_ranks_output_not_torchruns():
    console = ConsoleFilter(debug=False)
    shown = console.feed("\r 10%|bar|\r 20%|bar|\nstep 3/6 | held-out 5.1\n")
    shown += console.feed("W1201 23:41:44.932000 21270 torch/distributed/elastic/api.py:1028] Sending SIGTERM\n")
    shown += console.feed("stemlm train: error: [rank 0] bad\n\nTraceback (most recent call last):\n  File")
    shown += console.feed(" x\nChildFailedError\n")
    assert shown == "\r 10%|bar|\r 20%|bar|\nstep 3/6 | held-out 5.1\n"
    assert (
        ConsoleFilter(debug=True).feed("Traceback (most recent call last):\n") == "Traceback (most recent call last):\n"
    )
