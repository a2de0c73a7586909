"""Experiment folders: a rerun of the same command resumes, anything else is refused and left untouched."""

import json

import pytest

from stemlm.errors import StemlmError
from stemlm.experiments.folders import MARKER, claim_out, start_unit


def test_claim_out_creates_and_reclaims_its_own_folder(tmp_path):
    out = claim_out(tmp_path / "runs" / "k", "knowledge")
    assert json.loads((out / MARKER).read_text()) == {"experiment": "knowledge"}
    (out / "seed0").mkdir()
    assert claim_out(out, "knowledge") == out  # the same experiment's folder is accepted again


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda p: (p.mkdir(), (p / "notes.txt").write_text("mine")), "not an experiment folder"),
        (lambda p: p.write_text("a file"), "not a folder"),
        (lambda p: (p.mkdir(), (p / MARKER).write_text('{"experiment": "bio"}')), "experiment bio"),
        (lambda p: (p.mkdir(), (p / MARKER).write_text("{broken")), "not valid JSON"),
    ],
)
def test_claim_out_refuses_other_folders_untouched(tmp_path, setup, message):
    target = tmp_path / "out"
    setup(target)
    before = _snapshot(tmp_path)
    with pytest.raises(StemlmError, match=message):
        claim_out(target, "knowledge")
    assert _snapshot(tmp_path) == before


def _snapshot(root):
    return sorted((str(p.relative_to(root)), p.read_bytes() if p.is_file() else None) for p in root.rglob("*"))


def test_claim_out_accepts_an_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    claim_out(tmp_path / "empty", "compare")
    assert (tmp_path / "empty" / MARKER).is_file()


def test_start_unit_restarts_own_interrupted_work_and_refuses_other_settings(tmp_path):
    unit = tmp_path / "seed0"
    start_unit(unit, {"steps": 10, "lrs": (1e-3,)})
    (unit / "partial.bin").write_bytes(b"x")
    start_unit(unit, {"lrs": [1e-3], "steps": 10})  # same settings (key order, tuple vs list): starts over
    assert not (unit / "partial.bin").exists()
    (unit / "result.json").write_text("{}")
    with pytest.raises(StemlmError, match="other settings"):
        start_unit(unit, {"steps": 20, "lrs": (1e-3,)})
    assert (unit / "result.json").read_text() == "{}"  # nothing lost


def test_start_unit_refuses_a_folder_it_did_not_start(tmp_path):
    unit = tmp_path / "seed0"
    unit.mkdir()
    (unit / "seed.json").write_text("{}")  # e.g. written by an older version or by hand
    with pytest.raises(StemlmError, match="other settings"):
        start_unit(unit, {"steps": 10})
    assert (unit / "seed.json").exists()


def test_start_unit_can_keep_its_record_outside_the_folder(tmp_path):
    unit, record = tmp_path / "runs" / "dense", tmp_path / "runs" / "dense.started.json"
    start_unit(unit, {"steps": 3}, record=record)
    assert not any(unit.iterdir()) and record.is_file()  # the trainer finds an empty folder
    (unit / "ckpt").write_text("partial")
    start_unit(unit, {"steps": 3}, record=record)
    assert not any(unit.iterdir())
    with pytest.raises(StemlmError, match="other settings"):
        start_unit(tmp_path / "runs" / "new", {"steps": 4}, record=record)
