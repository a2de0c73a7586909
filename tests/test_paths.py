"""The path guards: regular files pass; missing paths, folders, FIFOs and devices are refused by name; symlinks are
refused for writes."""

import os

import pytest

from stemlm.errors import StemlmError
from stemlm.paths import input_file, refuse_symlink


def test_a_regular_file_and_a_link_to_one_pass(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("x")
    (tmp_path / "link").symlink_to(f)
    assert input_file(f) == f
    assert input_file(tmp_path / "link") == tmp_path / "link"


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p, "does not exist"),
        (lambda p: (p.mkdir(), p)[1], "is a folder"),
        (lambda p: (os.mkfifo(p), p)[1], "not a regular file"),
        (lambda p: __import__("pathlib").Path("/dev/zero"), "not a regular file"),
    ],
    ids=["missing", "folder", "fifo", "device"],
)
def test_what_is_not_a_regular_file_is_refused_by_name(tmp_path, make, message):
    path = make(tmp_path / "thing")
    with pytest.raises(StemlmError, match=message) as info:
        input_file(path, "data file")
    assert str(path) in str(info.value) and str(info.value).startswith("data file")


def test_a_symlink_is_refused_for_writing(tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_text("{}")
    (tmp_path / "run_config.json").symlink_to(target)
    with pytest.raises(StemlmError, match="is a symlink"):
        refuse_symlink(tmp_path / "run_config.json", "run config")
    assert refuse_symlink(target) == target
