"""The one registry of table placements (stemlm.placement.registry): one set of `--tables` words for training and
inference ("resident" the same as "device"), a placement chosen by word, purpose and world, one-line errors for
unknown or unserved words, and no two placements answering the same question. Run:
`python -m pytest tests/placement/test_registry.py -q`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import stemlm
from stemlm.errors import StemlmError
from stemlm.placement.base import INFERENCE, TRAIN, Placement
from stemlm.placement.registry import (
    ENTRY_POINT_GROUP,
    PLACEMENTS,
    choose,
    register,
    register_entry_points,
    resolve,
    tables_values,
)
from stemlm.train.config import TrainConfig


def test_resident_and_device_are_one_placement():
    assert resolve("resident", INFERENCE) == resolve("device", INFERENCE) == "device"
    assert choose("resident", INFERENCE) is choose("device", INFERENCE)
    assert resolve("mmap", INFERENCE) == "mmap"
    assert TrainConfig(tables="resident").tables == "device"
    assert tables_values(TRAIN) == ("device", "host", "resident")
    assert tables_values(INFERENCE) == ("device", "host", "mmap", "resident")
    assert tables_values(TRAIN, aliases=False) == ("device", "host")


def test_a_placement_is_chosen_by_word_purpose_and_world():
    chosen = {
        (word, purpose, distributed): choose(word, purpose, distributed=distributed).name
        for word in ("device", "host")
        for purpose in (TRAIN, INFERENCE)
        for distributed in (False, True)
    }
    assert chosen == {
        ("device", TRAIN, False): "resident",
        ("device", TRAIN, True): "row-sharded",
        ("device", INFERENCE, False): "resident",
        ("device", INFERENCE, True): "resident",  # inference has no world: one process
        ("host", TRAIN, False): "host",
        ("host", TRAIN, True): "host-sharded",
        ("host", INFERENCE, False): "host",
        ("host", INFERENCE, True): "host",
    }
    assert choose("mmap", INFERENCE).offloaded and not choose("device", INFERENCE).offloaded
    assert choose("device", INFERENCE).compiles and not choose("host", INFERENCE).compiles


def test_unknown_or_unserved_placements_are_one_line_errors():
    with pytest.raises(StemlmError, match=r"placement 'disk'; choose one of device \(or resident\), host, mmap$"):
        resolve("disk", INFERENCE)
    with pytest.raises(StemlmError, match="unknown table placement 'mmap'; choose one of device .or resident., host$"):
        choose("mmap", TRAIN)
    with pytest.raises(StemlmError, match="tables must be one of device, host, got 'mmap'"):
        TrainConfig(tables="mmap")


def test_two_placements_cannot_answer_one_question():
    class Twin(Placement):
        name = "twin"
        tables = "host"

    class Renamed(Placement):
        name = "host"
        tables = "elsewhere"

    class Thief(Placement):
        name = "thief"
        tables = "stolen"
        aliases = ("resident",)

    for cls, message in ((Twin, "both answer --tables host"), (Renamed, "named 'host' is already"), (Thief, "clash")):
        with pytest.raises(StemlmError, match=message):
            register(cls)
        assert PLACEMENTS.get(cls.name) is not cls


def test_a_broken_plugin_is_left_out_with_a_warning_naming_it(monkeypatch):
    import importlib.metadata

    points = [
        importlib.metadata.EntryPoint("gone", "no_such_module_for_stemlm:Tables", ENTRY_POINT_GROUP),
        importlib.metadata.EntryPoint("odd", "os:path", ENTRY_POINT_GROUP),
        importlib.metadata.EntryPoint("again", "stemlm.placement.host:HostTables", ENTRY_POINT_GROUP),  # already in
    ]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: points if group == ENTRY_POINT_GROUP else [])
    before = dict(PLACEMENTS)
    with pytest.warns(UserWarning) as caught:
        problems = register_entry_points()
    assert [str(w.message) for w in caught] == problems
    assert [p.split(" left out: ")[0] for p in problems] == [
        "table placement plugin gone (no_such_module_for_stemlm:Tables)",
        "table placement plugin odd (os:path)",
    ]
    assert "not a Placement subclass" in problems[1]
    assert PLACEMENTS == before


def placement_words() -> set[str]:
    return {word for cls in PLACEMENTS.values() for word in (cls.name, cls.tables, *cls.aliases)}


def name_branches(tree: ast.AST, words: set[str]) -> list[str]:
    """Comparisons with a placement word (`x == "host"`, `x in ("host", "mmap")`), and dicts keyed by two or more
    placement names (a name -> phrase table). "device" counts only where the other side speaks of tables."""
    names = words - {"device"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            operands = [
                e for side in sides for e in (side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side])
            ]
            constants = [c.value for c in operands if isinstance(c, ast.Constant)]
            hit = {c for c in constants if isinstance(c, str)} & names
            if "device" in constants and "tables" in ast.unparse(node):
                hit.add("device")
            if hit:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            if len(keys & names) >= 2:
                found.append(f"line {node.lineno}: a dict keyed by placement names")
    return found


def test_no_code_outside_the_placement_package_branches_on_a_placement_name():
    package = Path(stemlm.__file__).parent
    found = {}
    for path in sorted(package.rglob("*.py")):
        if path.parent.name == "placement":
            continue
        branches = name_branches(ast.parse(path.read_text()), placement_words())
        if branches:
            found[str(path.relative_to(package))] = branches
    assert found == {}


def test_the_scan_finds_the_branches_it_looks_for():
    words = placement_words()
    assert len(name_branches(ast.parse('if tables == "host": pass'), words)) == 1
    assert len(name_branches(ast.parse('ok = cfg.tables in ("device", "x")'), words)) == 1
    assert len(name_branches(ast.parse('where = {"resident": "on", "mmap": "mapped"}[kind]'), words)) == 1
    assert name_branches(ast.parse('if device.type == "cuda" or x == "device": pass'), words) == []
