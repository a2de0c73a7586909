"""`stemlm train --nproc 2` failing inside the ranks, or stopped after its last step: what the launcher reports.

An error only the ranks can see (here: divergence at step 2, before any checkpoint) comes back as the first
failing rank's own line naming RUN/launch.log, which keeps torchrun's full output; with no checkpoint there is
no resume advice.
A SIGTERM that arrives once the last step is saved reports a completed run (exit 0), not a failure.
Run: `OMP_NUM_THREADS=1 python -m pytest tests/train/parallel/test_launch_failures.py -q` (about a minute).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from stemlm.train.guard import run_finished

from .test_train_dist import cli_args, run_stemlm


@pytest.mark.dist
@pytest.mark.slow
def test_an_error_inside_the_ranks_is_one_line_naming_the_log(dist_assets, tmp_path):
    run = tmp_path / "run"
    argv = [*cli_args(dist_assets, run), "--lr", "1e30", "--max-skipped", "1", "--nproc", "2"]
    proc = run_stemlm(argv, dist_assets)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("stemlm train: starting 2 processes")
    # Rank 0's note, nothing else; rank 1 (which logs nothing) may raise and get rank 0 stopped before it is written.
    assert lines[1:-1] in ([], ["step 2: non-finite loss or gradient norm, update skipped"])
    assert lines[-1].startswith("stemlm train: error: training diverged")
    assert re.search(rf"\(rank [01] of 2; full log: {re.escape(str(run / 'launch.log'))}\)$", lines[-1])  # no advice
    log = (run / "launch.log").read_text()
    assert "[rank 1] training diverged" in log and "ChildFailedError" in log


@pytest.mark.dist
@pytest.mark.slow
def test_a_stop_after_the_last_step_is_a_completed_run(dist_assets, tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STEMLM_CACHE": str(dist_assets["cache"])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "stemlm.cli.main", *cli_args(dist_assets, run), "--nproc", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # no terminal: the launcher forwards the signal to torchrun itself
    )
    pointer, deadline = run / "checkpoints" / "latest.json", time.monotonic() + 240
    while not (pointer.is_file() and json.loads(pointer.read_text())["step"] == 6):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "distributed training failed" not in err
    assert run_finished(run)
