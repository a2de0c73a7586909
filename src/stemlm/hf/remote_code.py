"""Model folders that load without stemlm: `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`.

    stemlm export runs/tiny --out ckpt/tiny-hf --remote-code      # then, with only torch + transformers:
    AutoModelForCausalLM.from_pretrained("ckpt/tiny-hf", trust_remote_code=True).generate(...)

`remote_code_files()` generates the Python files from stemlm's own source each time it runs, so they cannot drift from
it: `configuration_stemlm.py`, `modeling_stemlm.py` and `heads_stemlm.py` are `stemlm.hf.configuration`,
`stemlm.hf.modeling` and `stemlm.hf.heads` (the task heads), and every stemlm module they need (found by following their
imports, function-level ones included, and every kind module) is copied beside them as `stemlm_<dotted path>.py`, its
`stemlm` imports rewritten as relative ones. That is the layout transformers' dynamic modules expect: one flat folder,
files found by following `from .x import` lines. Two things in the source cannot be copied as they are, and are
rewritten by name: an import of a stemlm package (there are no packages in the folder; one is refused) and the kind
registry's `_found_kinds`, which discovers kinds by listing a package and here imports the copied kind files by name.

`add_remote_code(folder, eos_token_id=...)` writes those files into a model folder and adds to its config.json the
`auto_map` naming the classes, with the special token ids `generate()` reads (also saved as generation_config.json).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import pkgutil
from pathlib import Path

from stemlm.errors import StemlmError

ENTRIES = {
    "stemlm.hf.configuration": "configuration_stemlm",
    "stemlm.hf.modeling": "modeling_stemlm",
    "stemlm.hf.heads": "heads_stemlm",
}
AUTO_MAP = {
    "AutoConfig": "configuration_stemlm.StemlmConfig",
    "AutoModel": "modeling_stemlm.StemlmModel",
    "AutoModelForCausalLM": "modeling_stemlm.StemlmForCausalLM",
    "AutoModelForSequenceClassification": "heads_stemlm.StemlmForSequenceClassification",
    "AutoModelForTokenClassification": "heads_stemlm.StemlmForTokenClassification",
    "AutoModelForQuestionAnswering": "heads_stemlm.StemlmForQuestionAnswering",
}
KINDS_PACKAGE = "stemlm.model.kinds"
REGISTRY = f"{KINDS_PACKAGE}.registry"


def flat_name(module: str) -> str:
    """The file stem of a stemlm module in the folder: `stemlm.model.ffn` -> `stemlm_model_ffn`."""
    return ENTRIES.get(module) or "stemlm_" + module.removeprefix("stemlm.").replace(".", "_")


def _spec(module: str):
    try:
        return importlib.util.find_spec(module)
    except ModuleNotFoundError:
        return None


def _is_plain_module(module: str) -> bool:
    spec = _spec(module)
    return spec is not None and spec.submodule_search_locations is None


def _kind_modules() -> list[str]:
    spec = _spec(KINDS_PACKAGE)
    names = [i.name for i in pkgutil.iter_modules(spec.submodule_search_locations)]
    return [f"{KINDS_PACKAGE}.{n}" for n in sorted(names) if n != "registry" and not n.startswith("_")]


def _found_kinds_source() -> str:
    """The registry's `_found_kinds` for the folder: the copied kind files, imported by name."""
    lines = [
        "def _found_kinds() -> list[Kind]:",
        '    """The `KIND` of every kind file of this folder (written by stemlm.hf.remote_code)."""',
    ]
    modules = _kind_modules()
    lines += [f"    from .{flat_name(m)} import KIND as kind_{i}" for i, m in enumerate(modules)]
    lines.append(f"    return [{', '.join(f'kind_{i}' for i in range(len(modules)))}]")
    return "\n".join(lines)


def _rewrite_import(node: ast.ImportFrom, where: str, needed: list[str]) -> list[str]:
    """The relative import(s) replacing `from stemlm.X import ...` (X a module, or names that are modules)."""
    statements, names = [], []
    for alias in node.names:
        target = f"{node.module}.{alias.name}"
        if _is_plain_module(target):  # `from stemlm.model.kinds import stem`: a module of a package
            needed.append(target)
            statements.append(f"from . import {flat_name(target)} as {alias.asname or alias.name}")
        else:
            names.append(alias.name if alias.asname is None else f"{alias.name} as {alias.asname}")
    if names:
        if not _is_plain_module(node.module):
            raise StemlmError(f"remote code: {where} imports names from the package {node.module}; import the module")
        needed.append(node.module)
        statements.insert(0, f"from .{flat_name(node.module)} import {', '.join(names)}")
    return statements


def _rewritten(module: str, needed: list[str]) -> str:
    """The source of `module` with its stemlm imports made relative (appending the modules it needs to `needed`)."""
    path = Path(_spec(module).origin)
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    edits = []  # (import or function node, the statements replacing it)
    replaced = set()
    if module == REGISTRY:
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "_found_kinds":
                edits.append((node, [_found_kinds_source()]))
                replaced = {id(n) for n in ast.walk(node)}
                needed += _kind_modules()
        if not replaced:
            raise StemlmError(f"remote code: {REGISTRY} has no _found_kinds to replace")
    for node in ast.walk(tree):
        if id(node) in replaced:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "stemlm":
            edits.append((node, _rewrite_import(node, module, needed)))
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "stemlm" for a in node.names):
            raise StemlmError(
                f"remote code: {module} line {node.lineno} imports a stemlm package; import from a module"
            )
    lines = text.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    for node, statements in sorted(edits, key=lambda e: (e[0].lineno, e[0].col_offset), reverse=True):
        start = offsets[node.lineno - 1] + node.col_offset
        end = offsets[node.end_lineno - 1] + node.end_col_offset
        indent = " " * node.col_offset
        text = text[:start] + ("\n" + indent).join(statements) + text[end:]
    relative = path.relative_to(Path(_spec("stemlm").origin).parent.parent).as_posix()
    return f"# Generated by stemlm.hf.remote_code from {relative}; regenerate rather than edit.\n{text}"


def remote_code_files() -> dict[str, str]:
    """File name -> text of every Python file a remote-code folder carries (see the module docstring)."""
    files, todo, done = {}, list(ENTRIES), set()
    while todo:
        module = todo.pop()
        if module in done:
            continue
        done.add(module)
        needed: list[str] = []
        files[f"{flat_name(module)}.py"] = _rewritten(module, needed)
        todo += needed
    return dict(sorted(files.items()))


def add_remote_code(folder: str | Path, *, eos_token_id=None, bos_token_id=None, pad_token_id=None) -> list[str]:
    """Write the remote-code files into the model folder `folder` and add `auto_map` and the special token ids
    to its config.json (and a generation_config.json with them); returns the names of the files written."""
    from transformers import GenerationConfig

    folder = Path(folder)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    if config.get("model_type") != "stemlm":
        raise StemlmError(f"{config_path}: model_type {config.get('model_type')!r} is not a stemlm model")
    written = []
    for name, text in remote_code_files().items():
        (folder / name).write_text(text, encoding="utf-8")
        written.append(name)
    ids = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
    config.update(auto_map=AUTO_MAP, **{k: v for k, v in ids.items() if v is not None})
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    GenerationConfig(**{k: v for k, v in ids.items() if v is not None}).save_pretrained(folder)
    return [*written, "generation_config.json"]
