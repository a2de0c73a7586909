"""Every documentation page works as written: README.md and each `docs/**/*.md` page, parametrised by page so a
new page is checked without editing this file.

- Python blocks run, each in a fresh namespace in a temporary working folder, in page order.
- Shell blocks name real subcommands and flags (parsed by the real parser, every flag spelled in full; cheap
  ones run), name scripts that exist, and use the venv's programs (`.venv/bin/stemlm`, `.venv/bin/python`,
  `.venv/bin/pip`): a bare `stemlm`, `python` or `pip` is not on a fresh clone's PATH after the set-up.
- Every inline `stemlm ...` span (the command table's cells included) names real subcommands, every
  alternative of `a|b`, and only flags those subcommands take.
- Relative links and images resolve to files that exist, and a `#anchor` to a heading of the page it names.
- Every `stemlm.a.b` name is a module or an attribute of one.
"""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest

from stemlm.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`]+)`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *$", re.M)
CHEAP = {"info"}  # subcommands run for real (milliseconds, no model weights)
NOT_ON_PATH = {"stemlm", "python", "python3", "pip"}


def page_id(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def blocks(page: Path, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(page.read_text()) if lang == language]


def prose(page: Path) -> str:
    """The page without its fenced blocks (headings, links and inline spans live here)."""
    return FENCE.sub("", page.read_text())


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


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for heading in HEADING.findall(prose(page)):
        base, n = slug(heading), 0
        while (name := base if n == 0 else f"{base}-{n}") in found:
            n += 1
        found.add(name)
    return found


def python_blocks() -> list[tuple[Path, int]]:
    return [(page, i) for page in PAGES for i in range(len(blocks(page, "python")))]


def test_pages_have_the_blocks_this_test_checks():
    readme = ROOT / "README.md"
    assert blocks(readme, "bash") and blocks(readme, "python")
    assert len(python_blocks()) >= 3 and (ROOT / "docs" / "guide.md") in PAGES


@pytest.mark.parametrize(("page", "index"), python_blocks(), ids=lambda v: page_id(v) if isinstance(v, Path) else v)
def test_python_blocks_run(page, index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = blocks(page, "python")[index]
    exec(compile(code, f"{page_id(page)} python block {index}", "exec"), {"__name__": f"doc_block_{index}"})


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_shell_blocks_use_real_commands_and_flags(page, capsys):
    parser = build_parser()
    for block in blocks(page, "bash"):
        for argv in shell_commands(block):
            command = shlex.join(argv)
            if any("$(" in word for word in argv):  # a command substitution: its inner program is not checked
                continue
            program = argv[0]
            assert program not in NOT_ON_PATH, f"{page_id(page)}: `{command}` needs .venv/bin/{program}"
            if program == ".venv/bin/stemlm":
                try:
                    args = parser.parse_args(argv[1:])
                except SystemExit as exc:  # argparse exits on an unknown subcommand or flag
                    raise AssertionError(f"{page_id(page)}: command does not parse: {command}") from exc
                check_inline_command(command)  # flags exactly as spelled: argparse would accept a prefix
                if args.command in CHEAP:
                    assert main(argv[1:]) == 0, command
            elif program == "bash":
                assert (ROOT / argv[1]).is_file(), f"{page_id(page)} runs {argv[1]}, which does not exist"
            elif program == ".venv/bin/python" and argv[1] not in ("-m", "-c"):
                assert (ROOT / argv[1]).is_file(), f"{page_id(page)} runs {argv[1]}, which does not exist"
    capsys.readouterr()


def inline_commands(page: Path) -> list[str]:
    spans = (" ".join(span.split()) for span in INLINE.findall(prose(page)))
    return [s for s in spans if s.startswith(("stemlm ", ".venv/bin/stemlm "))]


def check_inline_command(span: str) -> None:
    """`stemlm a\\|b ... --flag`: every alternative subcommand exists and takes every flag shown."""
    text = span.replace("\\|", "|").replace("[", " ").replace("]", " ")
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
            raise AssertionError(f"`{span}`: stemlm {' '.join(path)} is not a sub-command") from None
        known = {opt for action in parser._actions for opt in action.option_strings}
        assert flags <= known, f"`{span}`: {sorted(flags - known)} not flags of stemlm {' '.join(path)}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_inline_commands_name_real_subcommands_and_flags(page):
    errors = []
    for span in inline_commands(page):
        try:
            check_inline_command(span)
        except AssertionError as exc:
            errors.append(str(exc))
    assert not errors, "\n".join(errors)


def test_the_command_table_is_checked():
    assert len(inline_commands(ROOT / "docs" / "guide.md")) >= 20


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(INLINE.sub("", prose(page))):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        path = (page.parent / file_part).resolve() if file_part else page
        name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading #{anchor} in {name}")
    assert not broken, f"{page_id(page)}: " + "; ".join(broken)


def resolves(name: str) -> bool:
    """`stemlm.a.b.c` is a module, or an attribute chain of the longest module prefix."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ModuleNotFoundError:
            continue
        for attr in parts[k:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_module_names_exist(page):
    """Every `stemlm.a.b` a page names still exists (the package was reorganised into layers once already)."""
    names = sorted(set(re.findall(r"\bstemlm(?:\.\w+)+", page.read_text())))
    missing = [name for name in names if not resolves(name)]
    assert not missing, f"{page_id(page)} names {missing}, which do not exist"


def test_the_readme_tree_names_every_top_level_package():
    """The README's annotated tree lists every package and public module of src/stemlm, so a new one is described."""
    tree = (ROOT / "README.md").read_text().split("## The package at a glance", 1)[1]
    listed = set(re.findall(r"^  (\w+)(?:/|\.py) ", tree, re.M))
    package = ROOT / "src" / "stemlm"
    present = {
        p.stem for p in package.iterdir() if not p.name.startswith(("_", ".")) and (p.is_dir() or p.suffix == ".py")
    }
    assert present <= listed, f"README's tree lacks {sorted(present - listed)}"


def test_ci_runs_the_quick_start_commands():
    """`.ci/run` is the quick start: the README's first block's two commands, as written (CI may add flags)."""
    setup, tests = (line.split("#")[0].strip() for line in blocks(ROOT / "README.md", "bash")[0].splitlines())
    ci = (ROOT / ".ci" / "run").read_text()
    assert setup in ci and tests in ci.splitlines(), (setup, tests)
