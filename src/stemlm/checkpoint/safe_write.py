"""Writes that never lose data: target checks, atomic folder replacement, SHA-256 manifests, `verify`.

Every command that writes a folder (edit --save, convert, the trainer's checkpoints, analyze / eval niah /
cache-sim --out, the playground's save) goes through `AtomicFolder(target, producer=..., force=..., sources=...)`:

- a target that is a file, or a non-empty folder, is refused unless `force`; even with `force` a folder is
  replaced only when its manifest says the same producer wrote it and it holds no other file, and never when
  it is, or contains, one of the command's `sources` (`check_target`, also called early by the CLI so a
  refusal costs nothing);
- the new folder is built in a temporary sibling; each file's SHA-256 goes into `stemlm-manifest.json`,
  files and folders get the permissions the user's umask allows (mkdtemp alone would leave 0700), everything
  is fsynced, then renamed into place; a replaced folder is moved aside to `.NAME.old` first and removed
  last, so at every instant a complete folder exists at or beside the target;
- a target that is a symlink is refused (the write would land in its target), and the temporary folder holds a
  marker (`.stemlm-partial.json`: producer, process id, host) until the rename, so the next run of the same
  writer on the same target removes what a killed run left (`remove_partials`: a `.NAME.tmp-*` folder whose
  marker names that producer and a process that is gone; a `.NAME.old` beside a complete NAME that producer
  wrote). Temporaries without a marker, another producer's, or a live process's are left alone.

`verify_folder` recomputes the sums (`stemlm verify CKPT`); loading never hashes, so it stays fast.
`atomic_write_text` is the same promise for one small file (temp file, fsync, rename; no leftover on error; a
symlink at the path or at the temp name is refused; a temp file a killed process left, `.NAME.tmp-<pid>` of a
process that is gone, is removed by the next write of that file).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterable
from pathlib import Path

from stemlm.errors import StemlmError
from stemlm.paths import refuse_symlink

MANIFEST_NAME = "stemlm-manifest.json"
MANIFEST_FORMAT = "stemlm-manifest-v1"
PARTIAL_NAME = ".stemlm-partial.json"  # inside a folder being written: who writes it (removed before the rename)
_CHUNK = 1 << 20


# ----- hashing and manifests -----
def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _files(folder: Path) -> list[str]:
    """Every file under `folder` (relative, '/'-separated), the manifest itself excluded."""
    return sorted(
        p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_NAME
    )


def write_manifest(folder: Path, producer: str) -> None:
    files = {
        name: {"sha256": sha256_file(folder / name), "bytes": (folder / name).stat().st_size} for name in _files(folder)
    }
    text = json.dumps({"format": MANIFEST_FORMAT, "producer": producer, "files": files}, indent=2, sort_keys=True)
    (folder / MANIFEST_NAME).write_text(text + "\n")


def read_manifest(folder: Path) -> dict | None:
    """The folder's manifest, or None when it has none or it is unreadable."""
    try:
        data = json.loads((folder / MANIFEST_NAME).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT or not isinstance(data.get("files"), dict):
        return None
    return data


def verify_folder(folder: str | Path) -> dict:
    """Recompute every recorded SHA-256: {"ok", "files", "changed", "missing", "unrecorded", "producer"}."""
    folder = Path(folder)
    if not folder.is_dir():
        raise StemlmError(f"{folder} is not a folder")
    if not (folder / MANIFEST_NAME).is_file():
        raise StemlmError(
            f"{folder} has no {MANIFEST_NAME} (written before checksums were recorded); nothing to verify"
        )
    manifest = read_manifest(folder)
    if manifest is None:
        raise StemlmError(f"{folder / MANIFEST_NAME} is corrupt")
    changed, missing = [], []
    for name, entry in sorted(manifest["files"].items()):
        path = folder / name
        if not path.is_file():
            missing.append(name)
        elif not isinstance(entry, dict) or sha256_file(path) != entry.get("sha256"):
            changed.append(name)
    unrecorded = [name for name in _files(folder) if name not in manifest["files"]]
    return {
        "ok": not (changed or missing),
        "files": len(manifest["files"]),
        "changed": changed,
        "missing": missing,
        "unrecorded": unrecorded,
        "producer": manifest.get("producer"),
    }


# ----- target checks -----
def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_target(
    target: str | Path, *, producer: str, force: bool = False, sources: Iterable[str | Path] = (), flag: str = "--out"
) -> None:
    """Raise a StemlmError unless writing a folder at `target` can lose nothing (see the module docstring)."""
    target = Path(target)
    refuse_symlink(target, flag)
    resolved = target.resolve()
    for source in sources:
        if _inside(Path(source).resolve(), resolved):
            what = "is" if Path(source).resolve() == resolved else "contains"
            raise StemlmError(f"{flag} {target} {what} the source {source}; write somewhere else")
    if not target.exists() and not target.is_symlink():
        return
    if not target.is_dir():
        raise StemlmError(f"{flag} {target} exists and is a file; choose another path")
    if not any(target.iterdir()):
        return
    if not force:
        raise StemlmError(f"{flag} {target} already exists and is not empty; choose another path or pass --force")
    manifest = read_manifest(target)
    if manifest is None or manifest.get("producer") != producer:
        raise StemlmError(
            f"{flag} {target} was not written by {producer}; --force replaces only that command's earlier output "
            "(remove the folder yourself if you mean it)"
        )
    extra = [name for name in _files(target) if name not in manifest["files"]]
    if extra:
        raise StemlmError(f"{flag} {target} holds files {producer} did not write (e.g. {extra[0]}); not replacing it")


# ----- writing -----
def current_umask() -> int:
    # /proc gives it without changing it; os.umask() sets it to read it, racing other threads' file creation.
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _apply_umask(folder: Path) -> None:
    mask = current_umask()
    for path in [folder, *folder.rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


def fsync_tree(directory: Path) -> None:
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicFolder:
    """Context manager yielding a temporary folder that becomes `target` only if the block succeeds.

    `producer` names the writing command in the manifest; `force` / `sources` as in `check_target`.
    `owned=True` skips the check: the caller guarantees `target` can only be its own earlier output (the
    trainer's `RUN/checkpoints/step-N`, which a resume from an older step rewrites).
    """

    def __init__(
        self,
        target: str | Path,
        *,
        producer: str = "stemlm",
        force: bool = False,
        sources: Iterable[str | Path] = (),
        owned: bool = False,
        flag: str = "--out",
    ) -> None:
        self.target, self.producer, self.owned = Path(target), producer, owned
        self.check = {"producer": producer, "force": force, "sources": list(sources), "flag": flag}

    def __enter__(self) -> Path:
        if not self.owned:
            check_target(self.target, **self.check)
        refuse_symlink(self.target, self.check["flag"])
        remove_partials(self.target, self.producer)
        parent = self.target.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.tmp-", dir=parent))
            marker = {"producer": self.producer, "pid": os.getpid(), "host": socket.gethostname()}
            (self.tmp / PARTIAL_NAME).write_text(json.dumps(marker) + "\n")
        except OSError as exc:
            raise StemlmError(f"cannot write to {parent}: {exc.strerror or exc}") from None
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if isinstance(exc, OSError) and not isinstance(exc, StemlmError):
                raise StemlmError(f"could not write {self.target}: {exc.strerror or exc}") from None
            return
        try:
            if not self.owned:  # again: something may have appeared at the target while the block ran
                check_target(self.target, **self.check)
            refuse_symlink(self.target, self.check["flag"])
            (self.tmp / PARTIAL_NAME).unlink(missing_ok=True)
            write_manifest(self.tmp, self.producer)
            _apply_umask(self.tmp)
            fsync_tree(self.tmp)
            old = self.target.with_name(f".{self.target.name}.old")
            if self.target.is_dir():
                shutil.rmtree(old, ignore_errors=True)
                os.replace(self.target, old)
            os.replace(self.tmp, self.target)
            shutil.rmtree(old, ignore_errors=True)
        except (OSError, StemlmError) as exc:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if isinstance(exc, StemlmError):
                raise
            raise StemlmError(f"could not write {self.target}: {exc.strerror or exc}") from None


def remove_partials(target: Path, producer: str) -> None:
    """Remove what a killed `AtomicFolder(target, producer=producer)` left beside `target` (module docstring)."""
    parent = target.parent
    if not parent.is_dir():
        return
    for tmp in parent.glob(f".{glob.escape(target.name)}.tmp-*"):
        if tmp.is_dir() and not tmp.is_symlink() and _abandoned(tmp / PARTIAL_NAME, producer):
            shutil.rmtree(tmp, ignore_errors=True)
    old = parent / f".{target.name}.old"
    if old.is_dir() and not old.is_symlink() and target.is_dir() and not target.is_symlink():
        if _producer(old) == producer == _producer(target):  # the replaced copy, its replacement in place
            shutil.rmtree(old, ignore_errors=True)


def _producer(folder: Path) -> str | None:
    manifest = read_manifest(folder)
    return manifest.get("producer") if manifest is not None else None


def _abandoned(marker: Path, producer: str) -> bool:
    """Whether a partial folder's marker names `producer` and a process of this host that is gone."""
    try:
        data = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return False
    if not isinstance(data, dict) or data.get("producer") != producer or data.get("host") != socket.gethostname():
        return False
    pid = data.get("pid")
    return isinstance(pid, int) and not _alive(pid)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # another user's process (or a pid we cannot test): not ours to judge
    return True


def atomic_write_text(path: str | Path, text: str) -> None:
    """Replace one file atomically: a temp sibling, fsync, rename; the temp file never outlives a failure."""
    path = refuse_symlink(Path(path))
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.tmp-(\d+)$")
    for stale in path.parent.glob(f".{glob.escape(path.name)}.tmp-*"):  # left by a killed writer of this file
        match = pattern.match(stale.name)
        if match and not stale.is_dir() and not _alive(int(match.group(1))):
            stale.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:  # also KeyboardInterrupt: no .tmp-<pid> leftover
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise StemlmError(f"could not write {path}: {exc.strerror or exc}") from None
        raise


def remove_leftovers(folder: Path, patterns: Iterable[str]) -> None:
    """Delete temp files/folders (`.X.tmp-*`, `.X.old`) a killed process left in `folder`."""
    for pattern in patterns:
        for path in folder.glob(pattern):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


# ----- single output files (eval --out FILE and the like) -----
def check_file_target(path: str | Path, *, force: bool = False, flag: str = "--out", sources: tuple = ()) -> None:
    """Raise unless a command may write the file `path`: never a folder, never under a file, never inside one of
    the folders it reads (`sources`: a checkpoint's own files are not results, --force or not), an existing file
    only with `force`."""
    path = Path(path)
    if path.is_dir():
        raise StemlmError(f"{flag} {path} is a folder; pass a file path")
    blocker = next((p for p in path.parents if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise StemlmError(f"{flag} {path}: {blocker} is a file, so nothing can be written under it")
    target = path.resolve()
    for source in sources:
        if target.is_relative_to(Path(source).resolve()):
            raise StemlmError(f"{flag} {path} is inside {source}, which this command reads; write it elsewhere")
    if path.exists() and not force:
        raise StemlmError(f"{flag} {path} already exists; choose another path or pass --force to replace it")


def write_output_file(path: str | Path, text: str, *, force: bool = False, flag: str = "--out") -> Path:
    """`check_file_target`, then write `text` atomically (the parent folder is created)."""
    path = Path(path)
    check_file_target(path, force=force, flag=flag)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StemlmError(f"cannot create {path.parent}: {exc.strerror or exc}") from None
    atomic_write_text(path, text)
    return path
