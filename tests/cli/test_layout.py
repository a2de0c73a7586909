"""The code layout the project promises: packages in layers, every import pointing down the layer order, no
import cycle anywhere, and CLI modules that share code only through the library and `cli.common`.
Read from the source with `ast`, so the test sees lazy (function-level) imports and `TYPE_CHECKING` ones too.

`LAYERS` is the declaration (lowest first; docs/architecture.md shows the same table): a module may import
its own package and any package in a lower layer, never one above. Packages in one layer never import each
other."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import stemlm

PACKAGE = Path(stemlm.__file__).parent
LAYERS = [
    ("errors", "choices"),  # StemlmError, the one-line error every command prints; every closed set of values
    ("_lazy", "runtime", "paths", "progress", "flags"),  # lazy exports; --device / --dtype; file guards; bars;
    # settings that carry their flags
    ("model",),  # ModelConfig, presets, the kinds, the decoder, accounting (one device, no I/O)
    ("checkpoint",),  # the folder format, sharded pieces, compact tables, atomic writes, loading a CKPT
    ("data",),  # corpus, tokenizers, shards, streaming, the synthetic worlds
    ("hf",),  # transformers integration
    ("offload",),  # table providers, the hot-row cache, prefetch
    ("placement",),  # where the tables live, for training and inference: one class per placement, one registry
    ("inference",),  # the loader with a table placement, sampling, chat, offloaded decoding
    ("convert",),  # retrofit, GGUF import, Llama export, table dtypes
    ("analysis",),
    ("edit",),
    ("evaluation",),
    ("train",),  # the trainer, its recipes, train/parallel (torch.distributed: DDP / FSDP2, DCP, launch)
    ("experiments",),
    ("serve", "vllm"),  # stemlm's own server; the vLLM plugin (imported by vLLM only)
    ("cli",),
]
LAYER_OF = {name: rank for rank, names in enumerate(LAYERS) for name in names}
# `train` is one command in two files: `train_launch` holds its multi-process launcher.
ALLOWED_CLI_IMPORTS = {"stemlm.cli.common", "stemlm.cli.train_launch"}
ENTRY_POINTS = {"cli/main.py", "__main__.py"}  # the dispatcher and `python -m stemlm`


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


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the stemlm modules it imports (a name imported from a package counts as its submodule if one
    exists, else as the package)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in imported_modules(path):
            while imported not in modules and "." in imported:
                imported = imported.rsplit(".", 1)[0]
            targets.add(imported)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):  # `from stemlm.pkg import submodule`
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("stemlm"):
                targets.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules)
        graph[name] = targets - {name}
    return graph


def top_level(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_every_top_level_module_and_package_has_a_layer():
    names = {
        p.stem if p.is_file() else p.name
        for p in PACKAGE.iterdir()
        if p.suffix == ".py" or (p / "__init__.py").is_file()
    }
    assert names - {"__init__", "__main__"} == set(LAYER_OF), sorted(names ^ set(LAYER_OF))


def test_imports_point_down_the_layers():
    offenders = []
    for module, targets in import_graph().items():
        if not top_level(module) or module.replace(".", "/").removeprefix("stemlm/") + ".py" in ENTRY_POINTS:
            continue
        for target in targets:
            if top_level(target) and top_level(target) != top_level(module):
                if LAYER_OF[top_level(target)] >= LAYER_OF[top_level(module)]:
                    offenders.append(f"{module} imports {target}")
    assert not offenders, offenders


def test_no_import_cycles():
    graph = import_graph()
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                component.append(w)
            on_stack.discard(v)
            if component:
                cycles.append(sorted([v, *component]))

    for v in list(graph):
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_package_inits_import_only_their_own_package():
    offenders = []
    for path in sorted(PACKAGE.rglob("__init__.py")):
        package = module_name(path)
        if package == "stemlm":
            continue
        for module in imported_modules(path):
            if not (module.startswith(package + ".") or module == "stemlm._lazy"):
                offenders.append(f"{package} imports {module}")
    assert not offenders, offenders


def test_architecture_doc_shows_the_declared_layers():
    doc = (PACKAGE.parents[1] / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \|", doc, re.M)
    shown = [tuple(re.findall(r"`([\w.]+)`", packages)) for _, packages in rows]
    assert shown == LAYERS, shown
