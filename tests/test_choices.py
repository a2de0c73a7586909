"""`stemlm.choices`: each closed set of values is written once. The source is read with `ast`, so a tuple, list or
set literal anywhere in `src/stemlm` that spells out one of the sets again (in any order) is found, and the
registries the sets mirror agree with them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import stemlm
from stemlm import choices
from stemlm.errors import StemlmError

PACKAGE = Path(stemlm.__file__).parent
# The sets; an *_ALIASES map names old values of a set (checked against it below).
SETS = {name: value for name, value in vars(choices).items() if name.isupper() and not name.endswith("_ALIASES")}


def string_literals(path: Path) -> list[tuple[int, frozenset[str]]]:
    """(line, values) of every tuple / list / set literal of two or more string constants in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 2:
            if all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                found.append((node.lineno, frozenset(e.value for e in node.elts)))
    return found


def test_the_sets_are_distinct_tuples_of_distinct_names():
    assert SETS and all(isinstance(v, tuple) and len(set(v)) == len(v) >= 2 for v in SETS.values()), SETS
    assert len({frozenset(v) for v in SETS.values()}) == len(SETS)


def test_an_old_value_names_a_current_one():
    assert all(
        old not in choices.EDIT_ROWS and new in choices.EDIT_ROWS for old, new in choices.EDIT_ROW_ALIASES.items()
    )
    assert choices.edit_row_kind("stem") == "tables" and choices.edit_row_kind("embed") == "embed"


def test_no_set_is_written_out_again():
    by_values = {frozenset(v): name for name, v in SETS.items()}
    repeats = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == Path(choices.__file__):
            continue
        for line, values in string_literals(path):
            if values in by_values:
                repeats.append(f"{path.relative_to(PACKAGE)}:{line} spells out stemlm.choices.{by_values[values]}")
    assert not repeats, repeats


def test_the_scan_finds_a_repeated_set(tmp_path):
    written = tmp_path / "m.py"
    written.write_text('DTYPES = ["bf16", "fp32", "auto"]\nONE = ("auto",)\n')
    assert string_literals(written) == [(1, frozenset(choices.COMPUTE_DTYPES))]


def test_the_recipe_registry_holds_exactly_the_recipes():
    from stemlm.train.recipes import get_recipe

    assert [type(get_recipe(name)).__name__ for name in choices.RECIPES] == ["StemlmRecipe", "OfficialRecipe"]
    with pytest.raises(StemlmError, match=f"choose one of {', '.join(choices.RECIPES)}$"):
        get_recipe("lingua")
