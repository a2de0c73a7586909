"""`stemlm train --nproc N`: run the same command in N worker processes under torchrun, report a failure in a line.

The parent process rebuilds the command line from the parsed flags (all of them except --nproc), runs
`python -m torch.distributed.run --standalone --nproc-per-node N -m stemlm.cli.main train ...`, appends all of
its output to RUN/launch.log, passes the workers' output through as it comes, and turns a failed job into one
error line: rank 0's own error (or the rank that failed first and its exit code), the log's path, and the command
that continues from the last checkpoint when the run has one (`stemlm.train.parallel.workers`, which also picks
the workers' trainer class and thread share). A stop (Ctrl-C, SIGTERM) that arrives after the last step was
saved reports the run as complete. Everything that can be checked before starting ranks was checked
(`stemlm.train.preflight`, called by `stemlm.cli.train`).
Tests: `OMP_NUM_THREADS=1 python -m pytest tests/train/parallel/test_train_dist.py -q`.
"""

from __future__ import annotations

import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

from stemlm.errors import StemlmError

# Namespace entries that are not flags of the workers' command line.
NOT_FORWARDED = {"nproc", "nnodes", "rdzv_endpoint", "func", "train_parser", "command", "debug", "help"}
STOPPED_MARK = "continue with: stemlm train --resume"  # rank 0's line after a stop by signal (Trainer.fit)


def worker_argv(args) -> list[str]:
    """The `stemlm train` command line of the parsed `args`, without --nproc (the workers' command)."""
    argv = ["--debug"] if getattr(args, "debug", False) else []
    argv.append("train")
    for action in args.train_parser._actions:
        if not action.option_strings or action.dest in NOT_FORWARDED:
            continue
        value = getattr(args, action.dest, None)
        flag = action.option_strings[-1]
        if value is None or value is False or value == []:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv.append(f"{flag}={value}")  # the = form: a value starting with "-" stays a value
    return argv


def launch_workers(args, run_dir: Path) -> int:
    """Run `stemlm train` in `args.nproc` processes under torchrun, logging to `run_dir`/launch.log; 0 on success,
    else StemlmError."""
    from stemlm.checkpoint.runs import step_checkpoints
    from stemlm.train.guard import LAUNCH_LOG, exit_code, open_launch_log, run_finished
    from stemlm.train.parallel.launch import torchrun_command
    from stemlm.train.parallel.workers import failure_message, run_torchrun

    cmd = torchrun_command(args.nproc, worker_argv(args), nnodes=args.nnodes, rdzv_endpoint=args.rdzv_endpoint)
    print(f"stemlm train: starting {args.nproc} processes: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    log_path = run_dir / LAUNCH_LOG
    with open_launch_log(log_path) as log:
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        log.write(f"===== {stamp}: {shlex.join(cmd)}\n".encode())
        code, tail, stopped_by = run_torchrun(cmd, log, debug=getattr(args, "debug", False))
    run = args.resume or args.out
    if stopped_by and STOPPED_MARK in tail:  # the ranks saved the last step
        again = f"stemlm train --resume {run} --nproc {args.nproc}"
        print(f"stemlm train: stopped by {stopped_by}; continue with: {again}", file=sys.stderr)
        return exit_code(stopped_by)
    if code != 0 and stopped_by and run_finished(run_dir):
        # torchrun ends with the signal's code although the ranks finished the last step and saved it.
        print(f"stemlm train: {stopped_by} arrived after the last step; the run is complete ({run})", file=sys.stderr)
        return 0
    if code != 0:
        resumable = bool(step_checkpoints(run_dir))
        raise StemlmError(failure_message(tail, code, args.nproc, run, str(log_path), resumable))
    return 0
