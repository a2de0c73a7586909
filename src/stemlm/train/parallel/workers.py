"""Running `stemlm train` in several processes: who is a worker, its trainer and thread share, and the parent's
relay of torchrun's output with a one-line failure.

`distributed_worker()` tells a rank that torchrun (or SLURM's srun) started from a plain process;
`trainer_class()` is `stemlm.train.distributed.DistributedTrainer` there, else `Trainer`; `default_threads()`
shares the CPU cores among the local ranks. The parent runs torchrun with `run_torchrun(cmd)`, which passes the
workers' output through as it comes and forwards one SIGINT / SIGTERM (the ranks then save the last step);
`failure_message` turns torchrun's failure summary into one line naming the rank that failed first.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

TAIL_CHARS = 20_000  # the end of the workers' stderr kept for torchrun's failure summary


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


def run_torchrun(cmd: list[str]) -> tuple[int, str, str | None]:
    """Run torchrun's `cmd`, relaying its output: (exit code, stderr tail, name of the signal that asked it to
    stop, or None)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with ForwardStop(proc) as stop:
        code, tail = _relay(proc)
    return code, tail, stop.requested


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


def failure_message(stderr_tail: str, code: int, nproc: int, run: str) -> str:
    """One line: which rank failed first and how (from torchrun's summary), and how to continue."""
    cause = stderr_tail.rpartition("Root Cause (first observed failure):")[2]
    rank = re.search(r"^\s*rank\s*:\s*(\d+)", cause, re.M)
    exitcode = re.search(r"^\s*exitcode\s*:\s*(-?\d+)", cause, re.M)
    if rank and exitcode:
        what = f"rank {rank.group(1)} of {nproc} exited with code {exitcode.group(1)}"
        if int(exitcode.group(1)) < 0:
            what += f" (killed by signal {-int(exitcode.group(1))})"
    else:
        what = f"torchrun exited with code {code}"
    return (
        f"distributed training failed: {what}; the other ranks were stopped (messages above). "
        f"Continue from the last checkpoint with: stemlm train --resume {run} --nproc {nproc}"
    )
