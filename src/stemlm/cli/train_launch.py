"""`stemlm train --nproc N`: run the same command in N worker processes under torchrun, report a failure in a line.

The parent process rebuilds the command line from the parsed flags (all of them except --nproc), runs
`python -m torch.distributed.run --standalone --nproc-per-node N -m stemlm.cli.main train ...`, passes the
workers' output through as it comes, and turns a failed job into one error line naming the rank that failed
first, its exit code and the command that continues from the last checkpoint. Inside the workers
`trainer_class()` picks `stemlm.train.distributed.DistributedTrainer` and `default_threads()` shares the CPU
cores among the local ranks. Tests: `OMP_NUM_THREADS=1 python -m pytest tests/train/parallel/test_train_dist.py -q`.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading

from stemlm.errors import StemlmError

# Namespace entries that are not flags of the workers' command line.
NOT_FORWARDED = {"nproc", "nnodes", "rdzv_endpoint", "func", "train_parser", "command", "debug", "help"}
TAIL_CHARS = 20_000  # the end of the workers' stderr kept for torchrun's failure summary
STOPPED_MARK = "continue with: stemlm train --resume"  # rank 0's line after a stop by signal (Trainer.fit)


def distributed_worker() -> bool:
    """Whether this process is one of several ranks that torchrun (or SLURM's srun) started."""
    from stemlm.train.parallel.launch import adopt_slurm_env

    adopt_slurm_env()
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def trainer_class():
    if distributed_worker():
        from stemlm.train.distributed import DistributedTrainer

        return DistributedTrainer
    from stemlm.train.trainer import Trainer

    return Trainer


def default_threads() -> int:
    """All cores for one process; an equal share for each of torchrun's local ranks."""
    return max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


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


def launch_workers(args) -> int:
    """Run `stemlm train` in `args.nproc` processes under torchrun; 0 on success, else StemlmError."""
    from stemlm.train.parallel.launch import torchrun_command

    cmd = torchrun_command(args.nproc, worker_argv(args), nnodes=args.nnodes, rdzv_endpoint=args.rdzv_endpoint)
    print(f"stemlm train: starting {args.nproc} processes: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with ForwardStop(proc) as stop:
        code, tail = _relay(proc)
    if stop.requested and STOPPED_MARK in tail:  # the ranks saved the last step
        from stemlm.train.guard import exit_code

        run = args.resume or args.out or "RUN_FOLDER"
        again = f"stemlm train --resume {run} --nproc {args.nproc}"
        print(f"stemlm train: stopped by {stop.requested}; continue with: {again}", file=sys.stderr)
        return exit_code(stop.requested)
    if code != 0:
        raise StemlmError(failure_message(tail, code, args))
    return 0


def _relay(proc: subprocess.Popen) -> tuple[int, str]:
    """Pass the workers' output through (stderr as it comes); (exit code, stderr tail) once all are done."""
    out: list[bytes] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
    reader.start()
    tail = ""
    # Forwarded in chunks, not lines: the progress bar redraws with carriage returns.
    while chunk := os.read(proc.stderr.fileno(), 65536):
        text = chunk.decode(errors="replace")
        sys.stderr.write(text)
        sys.stderr.flush()
        tail = (tail + text)[-TAIL_CHARS:]
    code = proc.wait()
    reader.join()
    sys.stdout.write(b"".join(out).decode(errors="replace"))
    sys.stdout.flush()
    return code, tail


class ForwardStop:
    """While torchrun runs: SIGINT / SIGTERM reach it once (it stops the ranks, which save the last step) and
    this process keeps relaying their output instead of dying, which would break their pipes mid-save.

    A Ctrl-C at a terminal already reaches torchrun (same foreground process group), so it is not sent twice.
    """

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.requested, self.previous = proc, None, {}

    def __enter__(self) -> ForwardStop:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:
            return
        self.requested = signal.Signals(signum).name
        if signum != signal.SIGINT or not _terminal_delivered_it():
            self.proc.send_signal(signum)

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _terminal_delivered_it() -> bool:
    """Whether this process runs in the terminal's foreground group (then a Ctrl-C also reached torchrun)."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except OSError:
        return False


def failure_message(stderr_tail: str, code: int, args) -> str:
    """One line: which rank failed first and how (from torchrun's summary), and how to continue."""
    cause = stderr_tail.rpartition("Root Cause (first observed failure):")[2]
    rank = re.search(r"^\s*rank\s*:\s*(\d+)", cause, re.M)
    exitcode = re.search(r"^\s*exitcode\s*:\s*(-?\d+)", cause, re.M)
    if rank and exitcode:
        what = f"rank {rank.group(1)} of {args.nproc} exited with code {exitcode.group(1)}"
        if int(exitcode.group(1)) < 0:
            what += f" (killed by signal {-int(exitcode.group(1))})"
    else:
        what = f"torchrun exited with code {code}"
    run = args.resume or args.out or "RUN_FOLDER"
    return (
        f"distributed training failed: {what}; the other ranks were stopped (messages above). "
        f"Continue from the last checkpoint with: stemlm train --resume {run} --nproc {args.nproc}"
    )
