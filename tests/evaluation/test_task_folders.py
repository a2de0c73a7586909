"""`eval lm --include-path`: lm-eval runs Python a task file names (`!function`), so a task folder that others
could write (world-writable, group-writable by another group, or owned by another user: the folder, a folder
inside it, a YAML or .py file) is refused with exit 2 and one line, unless `--allow-task-code`.

Run: `python -m pytest tests/evaluation/test_task_folders.py -q`.
"""

from __future__ import annotations

import json
import os

import pytest

from stemlm.cli.main import main
from stemlm.errors import StemlmError
from stemlm.evaluation.task_folders import check_task_folder
from tests.bad_input import refuse
from tests.evaluation.test_lm_eval_adapter import _user_task

pytestmark = pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX permissions")
OTHER_ID = 54321  # a uid / gid nobody here has
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")


def world_writable(path):
    path.chmod(path.stat().st_mode | 0o002)


def give_away(path):
    os.chown(path, OTHER_ID, -1)


def group_writable_by_another_group(path):
    os.chown(path, -1, OTHER_ID)
    path.chmod(path.stat().st_mode | 0o020)


def helper_module(folder):
    (folder / "utils.py").write_text("def process(docs):\n    return docs\n")
    return folder / "utils.py"


CASES = [
    (lambda f: f, world_writable, "is world-writable"),
    (lambda f: f / "my_task.yaml", world_writable, "is world-writable"),
    (lambda f: f / "data", world_writable, "is world-writable"),
    (helper_module, world_writable, "is world-writable"),
    pytest.param(lambda f: f, give_away, "is owned by another user", marks=as_root),
    pytest.param(lambda f: f / "my_task.yaml", give_away, "is owned by another user", marks=as_root),
    pytest.param(helper_module, give_away, "is owned by another user", marks=as_root),
    pytest.param(lambda f: f, group_writable_by_another_group, f"is writable by group {OTHER_ID}", marks=as_root),
]


@pytest.mark.parametrize("target, spoil, message", CASES)
def test_untrusted_task_folder_is_refused(tiny_ckpt, tmp_path, capsys, target, spoil, message):
    folder = _user_task(tmp_path / "tasks")
    spoil(target(folder))
    line = refuse(["eval", "lm", tiny_ckpt, "--tasks", "my_task", "--include-path", folder], message, capsys, tmp_path)
    assert "--allow-task-code" in line and "!function" in line


def test_allow_task_code_accepts_it(tiny_ckpt, tmp_path, capsys):
    folder = _user_task(tmp_path / "tasks")
    world_writable(folder)
    args = ["eval", "lm", str(tiny_ckpt), "--tasks", "my_task", "--include-path", str(folder), "--json"]
    assert main([*args, "--allow-task-code"]) == 0
    assert "my_task" in json.loads(capsys.readouterr().out)["results"]


def test_data_files_and_own_folders_pass(tmp_path):
    folder = _user_task(tmp_path / "tasks")
    world_writable(folder / "data" / "d.jsonl")  # data, not code: lm-eval never runs it
    folder.chmod(0o750)
    assert check_task_folder(folder) == folder
    with pytest.raises(StemlmError, match="is not a folder of task YAML files"):
        check_task_folder(tmp_path / "missing")
