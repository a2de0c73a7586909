"""A killed writer's temporaries are removed by the next run of that writer on the same target, and only those.

Each writer (`export`, `convert --table-dtype`, `convert --to-llama`, `convert --from-dense`, `edit --save`) is
killed once for real (SIGKILL in a child process, inside `AtomicFolder` with the writer's producer, half a file
written), then run on the same target: the `.NAME.tmp-*` folder is gone and the output is complete. A
temporary of another producer, of a live process, or without stemlm's marker is left alone; so is the only copy
of a replaced folder (`.NAME.old` without NAME).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import stemlm
from stemlm.checkpoint.safe_write import PARTIAL_NAME, AtomicFolder, atomic_write_text, read_manifest
from stemlm.cli.main import main
from tests.small_corpus import write_small_corpus
from tests.train import bad_run_workspace

KILLED = """
import os, signal, sys
from stemlm.checkpoint.safe_write import AtomicFolder
tmp = AtomicFolder(sys.argv[1], producer=sys.argv[2]).__enter__()
(tmp / "model.safetensors").write_bytes(b"half a file" * 1000)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("leftovers")
    (root / "assets").mkdir()
    assets = write_small_corpus(root / "assets")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STEMLM_CACHE", str(assets["cache"]))
        return bad_run_workspace.build(root, assets)


def kill_a_writer(target: Path, producer: str) -> Path:
    env = {**os.environ, "PYTHONPATH": str(Path(stemlm.__file__).parents[1])}
    proc = subprocess.run([sys.executable, "-c", KILLED, str(target), producer], env=env, check=False)
    assert proc.returncode == -signal.SIGKILL
    (left,) = target.parent.glob(f".{target.name}.tmp-*")
    assert (left / PARTIAL_NAME).is_file()
    return left


WRITERS = [
    ("stemlm export", ["export", "{run}", "--out", "{out}"]),
    ("stemlm convert", ["convert", "{run}", "--table-dtype", "int8", "--out", "{out}"]),
    ("stemlm convert --to-llama", ["convert", "--to-llama", "{dense}", "--out", "{out}"]),
    ("stemlm convert", ["convert", "--from-dense", "{dense}", "--stem-layers", "1", "--out", "{out}"]),
]


@pytest.mark.parametrize(("producer", "argv"), WRITERS)
def test_the_next_run_removes_a_killed_runs_temporary(ws, tmp_path, producer, argv):
    out = tmp_path / "out"
    left = kill_a_writer(out, producer)
    assert main([a.format(run=ws / "run", dense=ws / "dense", out=out) for a in argv]) == 0
    assert not left.exists() and read_manifest(out)["producer"] == producer
    assert not (out / PARTIAL_NAME).exists()


def test_edit_save_removes_a_killed_saves_temporary(ws, tmp_path):
    out = tmp_path / "edited"
    left = kill_a_writer(out, "stemlm edit --save")
    argv = [
        "edit",
        str(ws / "run"),
        "--source",
        "king",
        "--target",
        "queen",
        "--allow-shared-subwords",
        "--save",
        str(out),
    ]
    assert main(argv) == 0
    assert not left.exists() and read_manifest(out)["producer"] == "stemlm edit --save"


def test_other_temporaries_are_left_alone(tmp_path):
    out = tmp_path / "out"
    other = kill_a_writer(out, "stemlm convert")  # another producer's
    live = tmp_path / f".{out.name}.tmp-live"
    live.mkdir()
    (live / PARTIAL_NAME).write_text(
        json.dumps({"producer": "stemlm export", "pid": os.getpid(), "host": socket.gethostname()})
    )
    unmarked = tmp_path / f".{out.name}.tmp-unmarked"
    unmarked.mkdir()
    with AtomicFolder(out, producer="stemlm export") as tmp:
        (tmp / "a.txt").write_text("a")
    assert other.is_dir() and live.is_dir() and unmarked.is_dir()
    assert sorted(p.name for p in out.iterdir()) == ["a.txt", "stemlm-manifest.json"]


def test_a_replaced_folders_old_copy_goes_only_beside_its_replacement(tmp_path):
    out = tmp_path / "out"
    with AtomicFolder(out, producer="stemlm export") as tmp:
        (tmp / "a.txt").write_text("1")
    old = tmp_path / ".out.old"
    shutil.copytree(out, old)  # killed after the swap, before the old copy was removed
    with AtomicFolder(out, producer="stemlm export", force=True) as tmp:
        (tmp / "a.txt").write_text("2")
    assert not old.exists()
    shutil.move(out, old)  # killed between the two renames: the old copy is the only one
    with AtomicFolder(tmp_path / "other", producer="stemlm export") as tmp:
        (tmp / "b.txt").write_text("b")
    assert old.is_dir()


def test_atomic_write_text_removes_a_dead_writers_temp_file_and_refuses_links(tmp_path):
    path = tmp_path / "latest.json"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".latest.json.tmp-{int(dead.stdout)}"
    stale.write_text("{")
    atomic_write_text(path, "{}")
    assert not stale.exists() and path.read_text() == "{}"
    (tmp_path / "target").write_text("keep")
    (tmp_path / "link.json").symlink_to(tmp_path / "target")
    with pytest.raises(stemlm.errors.StemlmError, match="link.json is a symlink"):
        atomic_write_text(tmp_path / "link.json", "{}")
    assert (tmp_path / "target").read_text() == "keep"


def test_a_symlinked_target_is_refused(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(stemlm.errors.StemlmError, match="is a symlink"), AtomicFolder(tmp_path / "link", owned=True):
        pass
    assert not any((tmp_path / "real").iterdir())
