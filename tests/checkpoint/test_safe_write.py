"""Tests of `stemlm.checkpoint.safe_write` through its users: nothing existing is replaced unless asked, never a
source or a folder another command wrote, permissions follow the umask, and every saved file's SHA-256 is verifiable."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from stemlm.checkpoint.folder import save_pretrained
from stemlm.checkpoint.runs import from_pretrained
from stemlm.checkpoint.safe_write import MANIFEST_NAME, AtomicFolder, atomic_write_text, check_target, verify_folder
from stemlm.cli.main import main
from stemlm.convert.driver import convert_checkpoint
from stemlm.data.tokenizer import default_tokenizer
from stemlm.edit.table_edits import TableEditor
from stemlm.errors import StemlmError


def tree(root) -> dict[str, str]:
    """Path -> SHA-256 of every file under root (the 'nothing changed on disk' check)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def ckpt(tmp_path, tiny_model):
    return save_pretrained(tiny_model("dense", vocab_size=default_tokenizer().get_vocab_size()), tmp_path / "ck")


def test_existing_folder_refused_without_force(tmp_path, tiny_model):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious")
    before = tree(tmp_path)
    with pytest.raises(StemlmError, match="already exists and is not empty"):
        save_pretrained(tiny_model("stem"), tmp_path / "mine")
    with pytest.raises(StemlmError, match="was not written by"):
        save_pretrained(tiny_model("stem"), tmp_path / "mine", force=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(StemlmError, match="is a file"):
        save_pretrained(tiny_model("stem"), tmp_path / "file", force=True)
    assert tree(tmp_path) == {**before, "file": hashlib.sha256(b"x").hexdigest()}


def test_force_replaces_only_the_same_commands_output(tmp_path, tiny_model):
    folder = save_pretrained(tiny_model("stem", seed=1), tmp_path / "out")
    save_pretrained(tiny_model("stem", seed=2), folder, force=True)  # same producer: replaced
    (folder / "mine.txt").write_text("added by the user")
    with pytest.raises(StemlmError, match="did not write"):
        save_pretrained(tiny_model("stem", seed=3), folder, force=True)
    assert (folder / "mine.txt").read_text() == "added by the user"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp or .old folder left


def test_never_replaces_its_source_or_a_folder_holding_it(tmp_path, ckpt):
    before = tree(tmp_path)
    for out in (ckpt, tmp_path):
        with pytest.raises(StemlmError, match="the source"):
            convert_checkpoint(ckpt, "odd", out, force=True)
    assert tree(tmp_path) == before


def test_edit_save_refuses_existing_and_source(tmp_path, ckpt, capsys):
    run = tmp_path / "run" / "checkpoints"
    run.mkdir(parents=True)
    os.rename(ckpt, run / "step-000001")
    (tmp_path / "run" / "run_config.json").write_text("{}")
    before = tree(tmp_path)
    for target in (tmp_path / "run", tmp_path):  # the run folder itself, and its parent
        argv = ["edit", str(tmp_path / "run"), "--source", "king", "--target", "queen", "--save", str(target)]
        assert main([*argv, "--force"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and ("contains the source" in err[0] or "is the source" in err[0])
    assert tree(tmp_path) == before


def test_editor_save_needs_force_and_an_earlier_edit(tmp_path, ckpt):
    model = from_pretrained(ckpt)
    editor = TableEditor(model, default_tokenizer())
    out = editor.save(tmp_path / "edited")
    with pytest.raises(StemlmError, match="--save .* already exists"):
        editor.save(out)
    editor.save(out, force=True)
    with pytest.raises(StemlmError, match="was not written by stemlm edit"):
        editor.save(ckpt, force=True)  # a save_pretrained folder, not an edit save


def test_manifest_records_sha256_and_verify_finds_corruption(tmp_path, ckpt, capsys):
    manifest = json.loads((ckpt / MANIFEST_NAME).read_text())
    weights = ckpt / "model.safetensors"
    assert manifest["files"]["model.safetensors"]["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert verify_folder(ckpt)["ok"]
    assert main(["verify", str(ckpt)]) == 0
    capsys.readouterr()
    data = bytearray(weights.read_bytes())
    data[-4096:] = b"\xff" * 4096  # inside tensor data: loading alone would not notice
    weights.write_bytes(bytes(data))
    result = verify_folder(ckpt)
    assert not result["ok"] and result["changed"] == ["model.safetensors"]
    assert main(["verify", str(ckpt)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.safetensors" in err[0]


def test_files_follow_the_umask(tmp_path, tiny_model):
    old = os.umask(0o022)
    try:
        folder = save_pretrained(tiny_model("stem"), tmp_path / "ck")
    finally:
        os.umask(old)
    assert folder.stat().st_mode & 0o777 == 0o755
    assert {p.stat().st_mode & 0o777 for p in folder.iterdir()} == {0o644}


def test_failed_block_and_atomic_text_leave_nothing(tmp_path):
    with pytest.raises(RuntimeError), AtomicFolder(tmp_path / "x", producer="t") as tmp:
        (tmp / "a").write_text("half")
        raise RuntimeError("crash")
    assert list(tmp_path.iterdir()) == []
    atomic_write_text(tmp_path / "f.json", "{}")
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_empty_folder_is_a_fine_target(tmp_path):
    (tmp_path / "empty").mkdir()
    check_target(tmp_path / "empty", producer="t")
    with AtomicFolder(tmp_path / "empty", producer="t") as tmp:
        (tmp / "a").write_text("a")
    assert (tmp_path / "empty" / "a").read_text() == "a"
