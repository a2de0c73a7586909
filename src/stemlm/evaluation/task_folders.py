"""The trust check of `--include-path` task folders: lm-eval runs Python code named in them.

A task YAML may say `!function utils.process_docs`, and lm-eval then imports `utils.py` from the YAML's folder
and runs it; that is lm-eval's design, so a task folder is code, not data. `check_task_folder` therefore refuses
a folder that someone else could have written: one where the folder, a folder inside it, or a YAML or Python
file in it is world-writable (or group-writable by a group other than the user's own) or owned by another
user (root's own files are trusted as the system's). `allow_task_code=True` (`--allow-task-code`) skips the
check for a folder the user has reviewed. Permission checks are POSIX-only; elsewhere nothing is refused.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from stemlm.errors import StemlmError

CODE_SUFFIXES = (".yaml", ".yml", ".py")


def _untrusted(path: Path, uid: int) -> str | None:
    """Why `path` could have been written by someone else, or None."""
    st = path.stat()
    if st.st_uid not in (uid, 0):
        return f"is owned by another user (uid {st.st_uid})"
    if st.st_mode & stat.S_IWOTH:
        return "is world-writable"
    if st.st_mode & stat.S_IWGRP and st.st_gid != os.getgid():
        return f"is writable by group {st.st_gid}"
    return None


def check_task_folder(folder: str | Path, allow_task_code: bool = False) -> Path:
    """`folder` if it is a folder whose task files (and the code they may import) only the user could write."""
    folder = Path(folder)
    if not folder.is_dir():
        raise StemlmError(f"--include-path {folder} is not a folder of task YAML files")
    if allow_task_code or not hasattr(os, "getuid"):
        return folder
    uid = os.getuid()
    for path in [folder, *sorted(folder.rglob("*"))]:
        if path.is_dir() or path.suffix in CODE_SUFFIXES:
            reason = _untrusted(path, uid)
            if reason is not None:
                raise StemlmError(
                    f"--include-path {folder}: {path} {reason}, and lm-eval runs Python code named in task files "
                    "(!function); fix its permissions, or pass --allow-task-code if you trust it"
                )
    return folder
