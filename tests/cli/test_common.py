"""`stemlm.cli.common.add_field_flags` / `stemlm.flags.given_fields`: a dataclass's settings become flags (in their
sections' groups, parsed by the field's annotation, None when not given) and read back as the fields the command line
gave."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from stemlm.cli.common import add_field_flags
from stemlm.experiments.contract import positive_lrs
from stemlm.flags import given_fields, setting


@dataclass
class Options:
    steps: int = setting(10, "steps (default {default})", section="run")
    lr: float | None = setting(None, "lr", section="run")
    mode: str = setting("a", "mode", section="other", one_of=("a", "b"))
    paths: list[str] | None = setting(None, "paths", section="other", metavar="PATH", many=True)
    tags: list[str] = setting([], "tags", section="other", name="--tag", append=True)
    fast: bool = setting(False, "fast", section="other", const=True)
    lrs: tuple[float, ...] = setting((0.1,), "lrs", section="other", parse=positive_lrs)
    width: int = 8  # no flag


def build(metavars=None) -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(prog="x", exit_on_error=False)
    groups = {section: parser.add_argument_group(section) for section in ("run", "other")}
    add_field_flags(groups, Options, metavars=metavars)
    return parser, groups


def test_flags_parse_by_annotation_and_read_back_as_given_fields():
    parser, _ = build()
    args = parser.parse_args(["--steps", "3", "--lr", "none", "--paths", "a", "b", "--tag", "t", "--fast"])
    assert given_fields(args, Options) == {"steps": 3, "paths": ["a", "b"], "tags": ["t"], "fast": True}
    assert given_fields(parser.parse_args([]), Options) == {}  # nothing given: every dest is None
    assert parser.parse_args(["--lrs", "1e-3,3e-3"]).lrs == (1e-3, 3e-3)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "x"], "option 'steps' expects an integer, got 'x'"),
        (["--mode", "c"], "invalid choice: 'c'"),
        (["--lrs", "0"], "learning rates must be positive"),
    ],
)
def test_a_bad_value_is_argparses_error(argv, message):
    parser, _ = build()
    with pytest.raises(argparse.ArgumentError, match=message):
        parser.parse_args(argv)


def test_help_groups_metavars_and_defaults():
    parser, groups = build(metavars={"int": "N", "float": "X"})
    shown = {g.title: [a.option_strings[0] for a in g._group_actions] for g in groups.values()}
    assert shown == {"run": ["--steps", "--lr"], "other": ["--mode", "--paths", "--tag", "--fast", "--lrs"]}
    actions = {a.dest: a for a in parser._actions}
    assert actions["steps"].metavar == "N" and actions["lr"].metavar == "X" and actions["paths"].metavar == "PATH"
    assert actions["steps"].help == "steps (default 10)" and "width" not in actions
