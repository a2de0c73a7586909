"""Shared checks of the bad-input suites: a refused command exits 2 with one stderr line naming the problem and
leaves every file it was given exactly as it was.

`tree(root)` fingerprints a folder (folders by name, small files by content, large ones by size/mtime/inode);
`refuse(argv, message, capsys, root)` runs `stemlm.cli.main.main(argv)` in-process and asserts the whole contract.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def tree(root: Path) -> dict[str, str]:
    """Every entry under root; symlinks by their target so a changed link shows, without following it."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = f"link:{p.readlink()}"
        elif p.is_dir():
            out[rel] = "dir"
        elif not p.is_file():
            out[rel] = "special"  # a FIFO or device: never read it
        else:
            st = p.stat()
            small = st.st_size < 65536
            out[rel] = (
                hashlib.sha256(p.read_bytes()).hexdigest() if small else f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
            )
    return out


def refuse(argv: list[str], message: str, capsys, root: Path) -> str:
    """Run the CLI on argv; assert exit 2, exactly one stderr line starting 'stemlm' and holding message, and no
    change under root. Returns the line."""
    from stemlm.cli.main import main

    before = tree(root)
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse
        code = exc.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1, err
    assert message in lines[0], lines[0]
    assert lines[0].startswith("stemlm"), lines[0]
    assert tree(root) == before
    return lines[0]
