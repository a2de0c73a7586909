"""The `stemlm` dispatcher: summaries in step with the subcommands' own, and only the invoked subcommand imported."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from stemlm.cli.main import SUBCOMMANDS, build_parser, command_of


def listed(parser: argparse.ArgumentParser) -> dict[str, str]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {choice.dest: choice.help for choice in action._choices_actions}


def test_every_summary_is_the_subcommand_modules_own():
    assert listed(build_parser()) == SUBCOMMANDS


@pytest.mark.parametrize("argv", [["--help"], ["info", "--preset", "tiny"], ["--debug", "train", "--help"]])
def test_the_lazy_parser_lists_every_subcommand(argv):
    assert listed(build_parser(argv)) == SUBCOMMANDS


def test_command_of():
    assert command_of(["--debug", "eval", "ppl", "run"]) == "eval"
    assert command_of(["--help"]) is None


IMPORTED = """
import json, sys
from stemlm.cli.main import main
main(sys.argv[1:])
print(json.dumps(sorted(m for m in sys.modules if m.startswith("stemlm.cli."))))
"""


def cli_modules_after(*argv: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", IMPORTED, *argv], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_only_the_invoked_subcommand_is_imported():
    modules = {f"stemlm.cli.{name.replace('-', '_')}" for name in SUBCOMMANDS}
    imported = set(cli_modules_after("info", "--preset", "tiny", "--json"))
    assert imported & modules == {"stemlm.cli.info"}


def test_a_bare_help_imports_no_subcommand():
    code = "import sys\nfrom stemlm.cli.main import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
    code += "print(sorted(m for m in sys.modules if m.startswith('stemlm.cli.')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines()[-1] == "['stemlm.cli.main']"
    assert (
        "torch"
        not in subprocess.run(
            [sys.executable, "-c", code.replace("'stemlm.cli.'", "'torch'")], capture_output=True, text=True
        ).stdout.splitlines()[-1]
    )
