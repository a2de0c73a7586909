"""Every code block of README.md works as written: Python blocks run, shell blocks name real subcommands and
flags (parsed by the real parser; cheap ones run), and every `stemlm ...` in the command table parses.

Python blocks run in a temporary working folder, each in a fresh namespace, in README order."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from stemlm.cli.main import build_parser, main

README = Path(__file__).resolve().parent.parent / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
CHEAP = {"info"}  # subcommands run for real (milliseconds, no model weights)


def blocks(language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(README.read_text()) if lang == language]


def shell_commands(block: str) -> list[list[str]]:
    """Each command of a shell block (split at &&, ||, ;, |), comments and line continuations removed."""
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        current: list[str] = []
        for word in [*words, ";"]:
            if word in ("&&", "||", ";", "|"):
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(word)
    return commands


def subparser(parser, path: list[str]):
    for name in path:
        (action,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
        parser = action.choices[name]
    return parser


def test_readme_has_the_blocks_this_test_checks():
    assert len(blocks("python")) >= 2 and len(blocks("bash")) >= 1


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_blocks_run(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = blocks("python")[index]
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": f"readme_block_{index}"})


def test_shell_blocks_use_real_commands_and_flags(capsys):
    repo = README.parent
    parser = build_parser()
    checked = 0
    for block in blocks("bash"):
        for argv in shell_commands(block):
            program = argv[0]
            if program in ("stemlm", ".venv/bin/stemlm"):
                try:
                    args = parser.parse_args(argv[1:])
                except SystemExit as exc:  # argparse exits on an unknown subcommand or flag
                    raise AssertionError(f"README command does not parse: {shlex.join(argv)}") from exc
                if args.command in CHEAP:
                    assert main(argv[1:]) == 0, shlex.join(argv)
                checked += 1
            elif program == "bash":
                assert (repo / argv[1]).is_file(), f"README runs {argv[1]}, which does not exist"
            elif program in ("python", ".venv/bin/python") and argv[1:2] != ["-m"]:
                assert (repo / argv[1]).is_file(), f"README runs {argv[1]}, which does not exist"
    capsys.readouterr()
    assert checked >= 2


def table_commands() -> list[str]:
    section = README.read_text().split("## Command line", 1)[1].split("\n## ", 1)[0]
    return [row.split(" | ")[0].strip("| ") for row in section.splitlines() if row.startswith("| `stemlm")]


@pytest.mark.parametrize("cell", table_commands())
def test_command_table_names_real_subcommands_and_flags(cell):
    """Each `stemlm a\\|b ... --flag` in the table's first column: every alternative subcommand exists and
    takes every flag shown."""
    text = cell.strip("`").replace("\\|", "|").replace("[", " ").replace("]", " ")
    words = text.split()[1:]
    names = []
    for word in words:
        if word.startswith("-") or word.isupper() or word.startswith('"') or not re.fullmatch(r"[a-z|-]+", word):
            break
        names.append(word.split("|"))
    flags = {w.split("=")[0] for w in words if w.startswith("--")}
    paths = [[]]
    for options in names:
        paths = [[*p, o] for p in paths for o in options]
    for path in paths:
        try:
            parser = subparser(build_parser(), path)
        except (KeyError, ValueError):
            raise AssertionError(f"{cell}: stemlm {' '.join(path)} is not a sub-command") from None
        known = {opt for action in parser._actions for opt in action.option_strings}
        assert flags <= known, f"{cell}: {sorted(flags - known)} not flags of stemlm {' '.join(path)}"
