"""Experiment output folders: resumable by rerunning the same command, never clobbering anything else.

An experiment's `--out` carries a marker (`experiment.json`, naming the experiment), so a rerun recognises its
own folder and refuses any other non-empty one. Inside it, each unit of work (a seed, a training run) records the
settings it was started with (`started.json`) before it writes anything; a rerun with the same settings may clear
that unit's leftovers from an interruption, and a unit started with other settings is refused, not recomputed:
a finished seed of another command is someone's result, and deleting it silently is the one thing an experiment
must not do.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from stemlm.errors import StemlmError

MARKER = "experiment.json"
STARTED = "started.json"


def _canonical(value) -> str:
    """Settings as canonical JSON text (tuples and lists compare equal, key order does not matter)."""
    return json.dumps(value, sort_keys=True, default=str)


def claim_out(out: Path, experiment: str) -> Path:
    """Make `out` the folder of `stemlm experiment <experiment>`: create it, or accept it when its marker names
    this experiment; refuse a file, a non-empty folder without the marker, or another experiment's folder."""
    out = Path(out)
    marker = out / MARKER
    if out.exists() and not out.is_dir():
        raise StemlmError(f"--out {out} exists and is not a folder; choose another --out")
    if marker.is_file():
        try:
            owner = json.loads(marker.read_text()).get("experiment")
        except (ValueError, AttributeError):
            raise StemlmError(f"--out {out}: {MARKER} is not valid JSON; choose another --out") from None
        if owner != experiment:
            raise StemlmError(f"--out {out} holds a `stemlm experiment {owner}` run, not {experiment}; choose another")
        return out
    if out.is_dir() and any(out.iterdir()):
        raise StemlmError(f"--out {out} exists and is not an experiment folder (no {MARKER}); choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"experiment": experiment}) + "\n")
    return out


def start_unit(folder: Path, settings, record: Path | None = None) -> None:
    """Before computing a unit of work into `folder`: clear what an interrupted start with the same `settings`
    left there, refuse a folder holding anything else, then record `settings` as this unit's (in `record`,
    default `folder/started.json`; a folder the trainer writes into must keep its record outside)."""
    folder = Path(folder)
    record = Path(record) if record is not None else folder / STARTED
    mine = record.is_file() and record.read_text() == _canonical(settings)
    if folder.is_dir() and any(folder.iterdir()):
        if not mine:
            raise StemlmError(f"{folder} holds a run with other settings; choose another --out or delete it")
        shutil.rmtree(folder)  # our own interrupted work: the same settings start over
    elif record.exists() and not mine:
        raise StemlmError(f"{record} records a run with other settings; choose another --out or delete it")
    folder.mkdir(parents=True, exist_ok=True)
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(_canonical(settings))
