"""The code layout the project promises: CLI modules share code only through the library and `cli.common`,
the library never imports the CLI, and the checkpoint format does not import the model (no import cycle).
Read from the source with `ast`, so the test sees lazy (function-level) imports too."""

from __future__ import annotations

import ast
from pathlib import Path

import stemlm

PACKAGE = Path(stemlm.__file__).parent
# `train` is one command in two files: `train_launch` holds its multi-process launcher.
ALLOWED_CLI_IMPORTS = {"stemlm.cli.common", "stemlm.cli.train_launch"}
ENTRY_POINTS = {"cli/main.py", "train/__main__.py"}  # the dispatcher and `python -m stemlm.train`


def imported_modules(path: Path, *, runtime_only: bool = False) -> set[str]:
    """Every `stemlm...` module imported anywhere in the file (skipping `if TYPE_CHECKING:` blocks if asked)."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    if runtime_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped.update(id(n) for n in ast.walk(node))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("stemlm"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("stemlm"))
    return found


def test_cli_modules_do_not_import_each_other():
    offenders = []
    for path in sorted((PACKAGE / "cli").glob("*.py")):
        if path.relative_to(PACKAGE).as_posix() in ENTRY_POINTS:
            continue
        for module in imported_modules(path):
            if module.startswith("stemlm.cli.") and module not in ALLOWED_CLI_IMPORTS:
                offenders.append(f"{path.name} imports {module}")
    assert not offenders, offenders


def test_library_never_imports_the_cli():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("cli/") or rel in ENTRY_POINTS:
            continue
        offenders += [f"{rel} imports {m}" for m in imported_modules(path) if m.startswith("stemlm.cli")]
    assert not offenders, offenders


def test_checkpoint_format_does_not_import_the_model():
    runtime = imported_modules(PACKAGE / "checkpoint.py", runtime_only=True)
    assert not {m for m in runtime if m.startswith("stemlm.model")}, runtime
    assert "stemlm.checkpoint" in imported_modules(PACKAGE / "model" / "decoder.py")  # the one direction left
