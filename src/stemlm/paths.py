"""Path guards shared by every reader and writer of user-given paths.

- `input_file(path, what)`: the path of an existing regular file to read. A missing path, a folder, a FIFO or a
  device file is refused by name, so a command never blocks on a pipe or reads `/dev/zero` forever.
- `refuse_symlink(path, what)`: a file a command is about to write (or replace) inside a folder it owns must not be
  a symlink, or the write would land in the link's target, outside that folder.
"""

from __future__ import annotations

import stat
from pathlib import Path

from stemlm.errors import StemlmError


def input_file(path: str | Path, what: str = "file") -> Path:
    """`path` as a Path if it is an existing regular file (symlinks to one are fine); else a one-line StemlmError."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise StemlmError(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise StemlmError(f"{what} {path} cannot be read ({exc.strerror or exc})") from None
    if stat.S_ISDIR(mode):
        raise StemlmError(f"{what} {path} is a folder, not a file")
    if not stat.S_ISREG(mode):
        raise StemlmError(f"{what} {path} is not a regular file (a FIFO, socket or device)")
    return path


def refuse_symlink(path: str | Path, what: str = "file") -> Path:
    """`path` as a Path unless it is a symlink, which a write would follow out of the folder being written."""
    path = Path(path)
    if path.is_symlink():
        raise StemlmError(f"{what} {path} is a symlink; stemlm does not write through links (remove it first)")
    return path
