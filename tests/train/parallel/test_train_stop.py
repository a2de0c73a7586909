"""`stemlm train --nproc 2` stopped by SIGTERM: every rank stops after the same step, the checkpoint of that step is
written, the launcher exits 143 with the --resume command, and the resumed run completes.
Run: `OMP_NUM_THREADS=1 python -m pytest tests/train/parallel/test_train_stop.py -q`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from stemlm.checkpoint.runs import resolve_checkpoint

from .test_train_dist import cli_args, run_stemlm, train_records


@pytest.mark.dist
@pytest.mark.slow
def test_sigterm_stops_all_ranks_with_a_checkpoint_then_resume(dist_assets, tmp_path):
    run = tmp_path / "run"
    argv = [a if a != "6" else "100000" for a in cli_args(dist_assets, run)]  # --steps: far more than will run
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STEMLM_CACHE": str(dist_assets["cache"])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "stemlm.cli.main", *argv, "--nproc", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # no terminal: the launcher forwards the signal to torchrun itself
    )
    deadline = time.monotonic() + 240
    while len(train_records(run) if (run / "metrics.jsonl").is_file() else []) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last == f"stemlm train: stopped by SIGTERM; continue with: stemlm train --resume {run} --nproc 2"
    ckpt = resolve_checkpoint(run)
    step = json.loads((ckpt / "trainer_state.json").read_text())["step"]
    assert [r["step"] for r in train_records(run)] == list(range(1, step + 1))  # the saved step is the last one
    assert (run / "loss.png").is_file()
    done = run_stemlm(["train", "--resume", str(run), "--steps", str(step + 2), "--nproc", "2"], dist_assets)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in train_records(run)] == list(range(1, step + 3))
