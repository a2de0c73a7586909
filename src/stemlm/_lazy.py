"""`lazy_exports`: a package-level `__getattr__` that imports a public name's module on first use.

Packages use it so `import stemlm` (and its subpackages) stays fast and never imports torch or transformers
until a name that needs them is touched.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], list[str]]:
    """Return (`__getattr__`, `__all__`) for a package whose names live in the modules `exports` maps them to."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__, sorted(exports)
