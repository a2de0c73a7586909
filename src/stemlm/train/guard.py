"""What keeps a training run safe to start, stop and leave alone: run-folder checks, signals, divergence.

- `check_run_dir(path)`: `--out` must be new, empty, or an earlier run folder of `stemlm train` without
  checkpoints; a model checkpoint folder (it holds config.json) or a folder with other files is refused, so a
  run never writes metrics.jsonl / loss.png over someone else's files. Folders that stemlm's own commands
  wrote there (`analyze`, `cache-sim`, `eval niah`: their manifest names a stemlm producer) belong to the
  run, so a finished run with reports is told to `--resume`, not called foreign (`check_no_checkpoints`).
- `check_run_links(run_dir)`: no file or folder the trainer writes in a run folder (run_config.json,
  metrics.jsonl, loss.png, launch.log, tensorboard/, profile/, checkpoints/ and what it holds) may be a symlink:
  the write would land in the link's target, outside the run. Checked before a new run or a resume writes.
- `open_launch_log(path)`, `run_finished(run_dir)`: the `--nproc N` launcher's log (appended to, never through a
  link) and whether a stopped job had saved its last step.
- `StopSignals`: while `fit()` runs, SIGINT (Ctrl-C) and SIGTERM only raise a flag; the trainer finishes the
  current step, saves a checkpoint of it, writes loss.png and metrics, and prints the `--resume` command. A
  second signal in a single process aborts at once (KeyboardInterrupt); in a torchrun worker it does not,
  because torchrun forwards the terminal's Ctrl-C as a SIGTERM of its own and kills stragglers itself.
- `DivergenceGuard`: after `max_skipped_in_row` consecutive skipped (non-finite) steps, a one-line
  StemlmError naming the step, the lr and the last finite loss.
- `maybe_inject_exit` (tests only): `STEMLM_FAULT_EXIT=RANK:STEP` makes that rank exit with status 1 just before
  it computes that (1-based) step, once its part of any checkpoint being written in the background is on disk (so
  the test knows which checkpoint survives; a real crash can lose the one in flight, never an earlier one).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from stemlm.checkpoint.folder import CONFIG_NAME
from stemlm.checkpoint.runs import CHECKPOINTS_DIR, STEP_DIR, resolve_checkpoint
from stemlm.checkpoint.safe_write import read_manifest
from stemlm.errors import StemlmError
from stemlm.paths import refuse_symlink
from stemlm.train.state import STATE_NAME, read_state_json

LAUNCH_LOG = "launch.log"  # the full output of every `--nproc N` launch of the run (`open_launch_log`)
# What an earlier `stemlm train` may have left in its run folder before its first checkpoint.
RUN_FOLDER_ENTRIES = {
    "run_config.json",
    "metrics.jsonl",
    "loss.png",
    LAUNCH_LOG,
    "tensorboard",
    "profile",
    CHECKPOINTS_DIR,
}
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def check_run_dir(path: str | Path) -> None:
    """Raise unless a new run may write into `path` (see the module docstring)."""
    path = Path(path)
    if not path.exists():
        return
    if not path.is_dir():
        raise StemlmError(f"--out {path} is a file; pass a folder for the run")
    if (path / CONFIG_NAME).is_file():
        raise StemlmError(
            f"--out {path} is a model checkpoint folder; train into a new folder (start from it with --init-from)"
        )
    check_run_links(path)
    others = [p for p in sorted(path.iterdir()) if p.name not in RUN_FOLDER_ENTRIES]
    foreign = [p.name for p in others if not _written_by_stemlm(p)]
    if foreign:
        raise StemlmError(
            f"--out {path} already holds files that are not a stemlm run (e.g. {foreign[0]}); choose another --out"
        )
    check_no_checkpoints(path)
    if others:  # reports of a run whose checkpoints are gone: a new run beside them would be mistaken for theirs
        raise StemlmError(
            f"--out {path} holds stemlm outputs ({', '.join(p.name for p in others)}) but no checkpoint; "
            "remove them or choose another --out"
        )


def check_run_links(run_dir: Path) -> None:
    """Raise if an entry the trainer writes in `run_dir` (or in its checkpoints/ folder) is a symlink."""
    run_dir = Path(run_dir)
    entries = [run_dir / name for name in sorted(RUN_FOLDER_ENTRIES)]
    folder = run_dir / CHECKPOINTS_DIR
    if folder.is_dir() and not folder.is_symlink():
        entries += sorted(folder.iterdir())
    for entry in entries:
        refuse_symlink(entry, "run folder entry")


def _written_by_stemlm(path: Path) -> bool:
    manifest = read_manifest(path) if path.is_dir() else None
    return manifest is not None and str(manifest.get("producer", "")).startswith("stemlm")


def check_no_checkpoints(run_dir: Path) -> None:
    """Refuse to start a new run in a run folder that has checkpoints: that run is continued with --resume
    (a finished one with a larger --steps, which the message says when the newest checkpoint records it)."""
    folder = run_dir / CHECKPOINTS_DIR
    names = [p.name for p in folder.iterdir()] if folder.is_dir() else []
    found = sorted((int(m.group(1)), name) for name in names if (m := STEP_DIR.match(name)))
    if not found:
        return
    step, newest = found[-1]
    planned = planned_steps(folder / newest)
    if planned is None:
        how = f"--resume {run_dir} (newest: step {step})"
    elif step >= planned:
        how = f"--resume {run_dir} --steps N (it finished its {planned} steps; N > {planned} trains further)"
    else:
        how = f"--resume {run_dir} (it stopped at step {step} of {planned})"
    raise StemlmError(f"run folder {run_dir} already has checkpoints; continue it with {how} or choose another --out")


def planned_steps(checkpoint: Path) -> int | None:
    """The step count the run of `checkpoint` was training toward (its trainer state), None if unreadable."""
    try:
        steps = json.loads((checkpoint / STATE_NAME).read_text())["config"]["train"]["steps"]
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        return None
    return steps if isinstance(steps, int) else None


def run_finished(run_dir: Path) -> bool:
    """Whether the run's newest checkpoint is at the last step it was training toward."""
    try:
        ckpt = resolve_checkpoint(run_dir)
        planned = planned_steps(ckpt)
        return planned is not None and read_state_json(ckpt)["step"] >= planned
    except (StemlmError, KeyError, TypeError):
        return False


def open_launch_log(path: Path):
    """The launch log (`LAUNCH_LOG`) opened for appending; never through a symlink (the run folder is created if
    new)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o666)
    except OSError as exc:
        if path.is_symlink():
            raise StemlmError(f"run folder entry {path} is a symlink; stemlm does not write through links") from None
        raise StemlmError(f"cannot write the launch log {path}: {exc.strerror or exc}") from None
    return os.fdopen(fd, "ab")


class StopSignals:
    """Context manager: SIGINT / SIGTERM set `requested` (the signal's name) instead of killing the process."""

    def __init__(self, abort_on_second: bool = True) -> None:
        self.requested: str | None = None
        self.abort_on_second = abort_on_second
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for sig in STOP_SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested is not None and self.abort_on_second:
            raise KeyboardInterrupt
        self.requested = self.requested or signal.Signals(signum).name

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class DivergenceGuard:
    """Counts consecutive skipped steps; raises once `limit` are reached (0 disables the stop)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.in_row, self.last_finite = limit, 0, None

    def update(self, record: dict[str, Any]) -> None:
        if not record["skipped"]:
            self.in_row = 0
            self.last_finite = record["loss"]
            return
        self.in_row += 1
        if self.limit and self.in_row >= self.limit:
            last = "none yet" if self.last_finite is None else f"{self.last_finite:.4f}"
            raise StemlmError(
                f"training diverged: {self.in_row} consecutive steps with a non-finite loss or gradient up to step "
                f"{record['step']} (lr {record['lr']:.3g}, last finite loss {last}); lower --lr or resume from an "
                "earlier checkpoint (--max-skipped 0 never stops)"
            )


def exit_code(signal_name: str) -> int:
    """The shell's code for a process ended by that signal: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + int(getattr(signal, signal_name))


FAULT_ENV = "STEMLM_FAULT_EXIT"


def maybe_inject_exit(rank: int, step: int, before=None) -> None:
    """Exit with status 1 if `FAULT_ENV` names this rank and step (after `before()`, e.g. a checkpoint's wait)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    target_rank, _, target_step = spec.partition(":")
    if int(target_rank) == rank and int(target_step) == step:
        if before is not None:
            before()  # this rank's part of a checkpoint in flight is written first: tests know which one survives
        print(f"{FAULT_ENV}: rank {rank} exits before step {step}", file=sys.stderr, flush=True)
        os._exit(1)
