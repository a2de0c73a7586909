"""Running `stemlm train` in several processes: who is a worker, its thread share, and the parent's relay of
torchrun's output with a one-line failure.

`distributed_worker()` tells a rank that torchrun (or SLURM's srun) started from a plain process (the trainer's
world, `stemlm.train.world.detect_world`, asks it); `default_threads()` shares the CPU cores among the local
ranks. The parent runs torchrun with `run_torchrun(cmd, log)`, which writes all of torchrun's output to the run's
launch log and passes the workers' output through as it comes, except torchrun's own log lines and tracebacks
and the ranks' error lines (`rank_error` tags them with the rank, `rank_errors` finds them again), and forwards
one SIGINT / SIGTERM (the ranks then save the last step); `failure_message` turns the failure into one line: the
error of the rank that failed first, or how it ended.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

TAIL_CHARS = 20_000  # the end of the workers' stderr kept for torchrun's failure summary
RANK_TAG = "stemlm train: error: [rank "  # how a rank's one-line error starts (`rank_error`)
# A rank's error line; a line printed by another process at the same moment may follow it without a newline.
RANK_ERROR = re.compile(r"stemlm train: error: \[rank (\d+)\] (.*?)(?=stemlm train: error: \[rank |\n|$)")
TORCHRUN_LOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ")  # torchrun's own log lines (glog format)
PIECE = re.compile(r"[^\n\r]*[\n\r]")  # a line, or one redraw of the progress bar


def distributed_worker() -> bool:
    """Whether this process is one of several ranks that torchrun (or SLURM's srun) started."""
    from stemlm.train.parallel.launch import adopt_slurm_env

    adopt_slurm_env()
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def default_threads() -> int:
    """All cores for one process; an equal share for each of torchrun's local ranks."""
    return max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def rank_error(rank: int, exc: BaseException) -> str:
    """A rank's error message, tagged so that the launcher can tell rank 0's line from the others'."""
    return f"[rank {rank}] {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}"


def rank_errors(text: str) -> dict[int, str]:
    """The first error line of each rank in the workers' output, by rank."""
    found: dict[int, str] = {}
    for match in RANK_ERROR.finditer(text):
        found.setdefault(int(match.group(1)), match.group(2).strip())
    return found


def run_torchrun(cmd: list[str], log, *, debug: bool = False) -> tuple[int, str, str | None]:
    """Run torchrun's `cmd`, relaying its output (all of it also to the binary file `log`): (exit code, stderr
    tail, name of the signal that asked it to stop, or None). `debug` relays everything (tracebacks too)."""
    from stemlm.progress import RELAYED_TERMINAL, shown

    # torchrun prints a banner when OMP_NUM_THREADS is unset and then sets it to 1; the ranks set their own threads.
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    if shown():  # rank 0's bar reaches this terminal (stemlm.progress)
        env[RELAYED_TERMINAL] = "1"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    with ForwardStop(proc) as stop:
        code, tail = _relay(proc, log, debug)
    return code, tail, stop.requested


def _relay(proc: subprocess.Popen, log, debug: bool) -> tuple[int, str]:
    """Pass the workers' output through (stderr as it comes, filtered by `ConsoleFilter`); (exit code, stderr
    tail) once all are done."""
    out: list[bytes] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
    reader.start()
    tail, console = "", ConsoleFilter(debug)
    while chunk := os.read(proc.stderr.fileno(), 65536):
        log.write(chunk)
        log.flush()
        text = chunk.decode(errors="replace")
        sys.stderr.write(console.feed(text))
        sys.stderr.flush()
        tail = (tail + text)[-TAIL_CHARS:]
    sys.stderr.write(console.feed("\n") if console.pending else "")
    code = proc.wait()
    reader.join()
    stdout = b"".join(out)
    log.write(stdout)
    sys.stdout.write(stdout.decode(errors="replace"))
    sys.stdout.flush()
    return code, tail


class ConsoleFilter:
    """What of the workers' stderr reaches the terminal: the ranks' progress bar, notes and evaluation lines as
    they come, not torchrun's log lines, not the ranks' tagged error lines (the launcher prints one), and nothing
    after the first traceback (the launch log keeps all of it). `debug`: everything."""

    def __init__(self, debug: bool) -> None:
        self.debug, self.pending, self.quiet, self.dropped = debug, "", False, False

    def feed(self, text: str) -> str:
        if self.debug:
            return text
        self.pending += text
        shown, end = [], 0
        for match in PIECE.finditer(self.pending):  # complete pieces only; the rest waits for its end
            end = match.end()
            piece = match.group()
            line = piece.strip("\r\n")
            self.quiet = self.quiet or line.startswith("Traceback (most recent call last)")
            drop = self.quiet or TORCHRUN_LOG.match(line) or line.startswith(RANK_TAG) or (not line and self.dropped)
            self.dropped = bool(drop)
            if not drop:
                shown.append(piece)
        self.pending = self.pending[end:]
        return "".join(shown)


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


def failure_message(stderr_tail: str, code: int, nproc: int, run: str, log: str, resumable: bool) -> str:
    """One line: the error of the rank that failed first (torchrun's root cause; without its summary, rank 0's or
    the lowest rank's), else how that rank ended (it printed no error: killed, or exited by itself), where the full
    log is, and how to continue when there is a checkpoint to continue from. Another rank's error is then only a
    consequence (a peer gone mid-collective) and stays in the log."""
    errors = rank_errors(stderr_tail)
    advice = f"; continue from the last checkpoint with: stemlm train --resume {run} --nproc {nproc}"
    advice = advice if resumable else ""
    cause = stderr_tail.rpartition("Root Cause (first observed failure):")[2]
    rank = re.search(r"^\s*rank\s*:\s*(\d+)", cause, re.M)
    exitcode = re.search(r"^\s*exitcode\s*:\s*(-?\d+)", cause, re.M)
    first = int(rank.group(1)) if rank else min(errors, default=None)
    if first in errors:
        return f"{errors[first]} (rank {first} of {nproc}; full log: {log}){advice}"
    if rank and exitcode:
        what = f"rank {rank.group(1)} of {nproc} exited with code {exitcode.group(1)}"
        if int(exitcode.group(1)) < 0:
            what += f" (killed by signal {-int(exitcode.group(1))})"
    else:
        what = f"torchrun exited with code {code}"
    return f"distributed training failed: {what}; the other ranks were stopped (full log: {log}){advice}"
