"""Flag errors name the subcommand they were given to, its --help and the closest flag it has; flags match only as
spelled (no argparse prefixes, so a typo never runs as another flag). Each case is a bad-input case: exit 2, one
stderr line, nothing changed. Run: `python -m pytest tests/cli/test_flag_errors.py -q`."""

from __future__ import annotations

import argparse

import pytest

from stemlm.cli.main import build_parser
from tests.bad_input import refuse


def line(command: str, flag: str, close: str = "") -> str:
    hint = f"did you mean {close}? " if close else ""
    return f"stemlm {command}: error: unrecognized argument {flag} ({hint}see stemlm {command} --help)"


CASES = [
    (["train", "--step", "2"], line("train", "--step", "--steps")),
    (["train", "--step=2"], line("train", "--step", "--steps")),
    (["train", "--steps", "2", "--bogus"], line("train", "--bogus")),
    (["info", "--pres", "tiny"], line("info", "--pres", "--preset")),
    (["info", "extra"], "stemlm info: error: unrecognized arguments: extra (see stemlm info --help)"),
    (["eval", "ppl", "CKPT", "--max-token", "3"], line("eval ppl", "--max-token", "--max-tokens")),
    (["data", "prepare", "a.txt", "--out", "o", "--worker", "1"], line("data prepare", "--worker", "--workers")),
    (["experiment", "knowledge", "--quik"], line("experiment knowledge", "--quik", "--quick")),
    (["cache-sim", "--fraction", "0.1"], line("cache-sim", "--fraction", "--fractions")),
    # A flag before the subcommand is the top-level parser's: its --debug, its --help.
    (["--debg", "info"], "stemlm: error: unrecognized argument --debg (did you mean --debug? see stemlm --help)"),
    (["--debg", "info", "--pres", "tiny"], "stemlm: error: unrecognized argument --debg (did you mean --debug?"),
]


@pytest.mark.parametrize(("argv", "message"), CASES, ids=[" ".join(argv) for argv, _ in CASES])
def test_a_flag_error_names_the_subcommand_and_the_closest_flag(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    refuse(argv, message, capsys, tmp_path)


def parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                yield from parsers(sub)


def test_no_parser_accepts_a_prefix_of_a_flag():
    every = list(parsers(build_parser()))
    assert len(every) > 20 and all(not p.allow_abbrev for p in every), [p.prog for p in every if p.allow_abbrev]
