"""A `stemlm data prepare` killed with SIGKILL mid-run leaves no worker process behind (they die with it), and the
next prepare to the same --out removes the temporary folder it left; folders that are not a dead prepare's (no
marker, or a live process's) are left alone. Waits are bounded polls; nothing asserts on elapsed time.

Linux only (the workers' death is the kernel's PR_SET_PDEATHSIG; processes are read from /proc).
Run: `python -m pytest tests/data/test_prepare_kill.py -q`.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stemlm.data import train_bpe
from stemlm.data.prepare import TMP_MARKER, prepare

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux /proc and prctl")
WORDS = "the quick brown fox jumps over a lazy dog while stems and tables hold every token row".split()


def children(pid: int) -> list[int]:
    """Live (non-zombie) processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            if int(ppid) == pid and state != "Z":
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def poll(condition, seconds: float = 120.0) -> bool:
    """Whether `condition()` came true within `seconds` (checked every 20 ms)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def big_corpus(folder: Path, files: int = 12, docs: int = 4000) -> None:
    """About 20 MB of jsonl: seconds of tokenizing on two workers, far more than the poll below needs."""
    folder.mkdir()
    rng = random.Random(0)
    for k in range(files):
        lines = (json.dumps({"text": " ".join(rng.choices(WORDS, k=80))}) for _ in range(docs))
        (folder / f"part-{k:02d}.jsonl").write_text("\n".join(lines) + "\n")


def test_killed_prepare_leaves_no_workers_and_the_next_run_cleans_up(tmp_path):
    big_corpus(tmp_path / "in")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "stemlm.cli.main", "data", "prepare", str(tmp_path / "in"), "--out", str(out),
           "--workers", "2", "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tmp = tmp_path / f".out.tmp-{proc.pid}"
    workers: list[int] = []

    def mid_run() -> bool:  # two workers started and at least one has written tokens
        workers[:] = children(proc.pid)
        parts = list(tmp.glob("*.bin")) if tmp.is_dir() else []
        return len(workers) >= 2 and any(p.stat().st_size > 0 for p in parts)

    try:
        assert poll(mid_run), "prepare never reached its workers' first writes"
        assert proc.poll() is None, "prepare finished before it could be killed; make the corpus larger"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        assert poll(lambda: not any(alive(pid) for pid in workers), 60), "workers outlived the killed prepare"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (tmp / TMP_MARKER).is_file() and not out.exists()  # what the kill left

    (tmp_path / "small.txt").write_text("one small document for the next run")
    tok = train_bpe(["one small document for the next run"] * 4, vocab_size=280)
    prepare([tmp_path / "small.txt"], tok, out, workers=1, progress=False)
    assert out.is_dir() and not tmp.exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_only_dead_prepares_folders_are_removed(tmp_path):
    (tmp_path / "in.txt").write_text("a document")
    tok = train_bpe(["a document"] * 4, vocab_size=280)
    unmarked, live = tmp_path / ".out.tmp-999999999", tmp_path / ".out.tmp-1"
    dead, other = tmp_path / ".out.tmp-999999998", tmp_path / ".other.tmp-999999997"
    for folder in (unmarked, live, dead, other):
        folder.mkdir()
        (folder / "part.bin").write_bytes(b"\0\0")
    for folder in (live, dead, other):
        (folder / TMP_MARKER).write_text("x\n")
    prepare([tmp_path / "in.txt"], tok, tmp_path / "out", progress=False)
    assert not dead.exists()  # a marked folder whose process is gone: a killed prepare's
    assert unmarked.exists() and live.exists() and other.exists()  # not ours, a live process's, another --out's
