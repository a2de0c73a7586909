"""The `stemlm` console script: dispatches to one module per subcommand.

Each subcommand module exposes `register(subparsers)`, which adds its parser and sets `func` to a
function taking the parsed namespace and returning an exit code. Errors a user can act on are printed as
one line on stderr with exit code 2; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys

# Subcommand -> its one-line summary, in the order `stemlm --help` lists them. Each is module
# `stemlm.cli.<name>` (dashes as underscores), imported only when its command runs, so `stemlm info` does not pay
# for the server's or the trainer's imports; tests/cli/test_main.py holds each summary to its module's own help.
SUBCOMMANDS = {
    "info": "parameter, FLOP and memory accounting of a model config",
    "train": "train a model (default: tiny STEM on the embedded corpus)",
    "tokenizer": "train or try a byte-level BPE tokenizer",
    "data": "tokenize a corpus into memory-mapped token shards for training",
    "generate": "sample a continuation of a prompt from a checkpoint",
    "convert": "import a GGUF model, retrofit a dense checkpoint into STEM, or export a dense one as Llama",
    "cache-sim": "hit rate of the hot-row table cache on real text",
    "edit": "swap an entity's STEM rows for another's (positional, global, inject)",
    "eval": "evaluate a checkpoint (edits, ...)",
    "analyze": "interpretability: angular spread, attribution, nearest tokens, ...",
    "experiment": "run a reproducible experiment (knowledge, ...)",
    "serve": "web playground and OpenAI-compatible API in one server (generate, STEM contributions, edits)",
    "verify": "check a checkpoint's files against the SHA-256 sums recorded at save",
    "export": "write a (sharded) training checkpoint as a plain model folder",
}


# Another name -> the subcommand it runs (its module registers the parser with these aliases).
ALIASES = {"server": "serve"}


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one stderr line naming the problem and the (sub)command's --help (exit 2);
    --help still shows usage. Flags match only as spelled (no prefixes: `--step 2` is not `--steps 2`), and an
    unknown flag is reported by the subcommand it was given to, with the closest flag it has."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)  # sub-parsers are built by this class too, so this covers them
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        # argparse would report leftovers from the top-level parser ("stemlm: error"); the (sub)command whose
        # part of the command line holds the first of them does: `stemlm train --step 2` -> train's error,
        # `stemlm --debg info` -> stemlm's own (its --debug).
        args = list(sys.argv[1:] if args is None else args)
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            owner_of(args, extras[0], chosen_parsers(self, parsed)).unrecognized(extras)
        return parsed

    def unrecognized(self, extras: list[str]):
        flags = [e.split("=", 1)[0] for e in extras if e.startswith("-")]
        if not flags:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        # Compared without the dashes, which every flag shares: "--bogus" is not close to "--out".
        known = {option.lstrip("-"): option for action in self._actions for option in action.option_strings}
        close = difflib.get_close_matches(flags[0].lstrip("-"), known, n=1)
        hint = f"did you mean {known[close[0]]}? " if close else ""
        self.exit(2, f"{self.prog}: error: unrecognized argument {flags[0]} ({hint}see {self.prog} --help)\n")


Chain = list[tuple[str, argparse.ArgumentParser]]  # (command word, parser), outermost first


def chosen_parsers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Chain:
    """The (sub)parsers the parsed `args` went through, outermost first, each with the command word that chose it
    ("" for the top level): `stemlm eval ppl ...` -> stemlm, eval, eval ppl."""
    chain = [("", parser)]
    while True:
        action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        chosen = getattr(args, action.dest, None) if action is not None else None
        if chosen not in getattr(action, "choices", {}):
            return chain
        parser = action.choices[chosen]
        chain.append((chosen, parser))


def owner_of(argv: list[str], extra: str, chain: Chain) -> argparse.ArgumentParser:
    """The innermost parser in `chain` whose command word comes before `extra` in `argv`."""
    where = next((i for i, a in enumerate(argv) if a == extra), len(argv))
    owner, start = chain[0][1], 0
    for word, parser in chain[1:]:
        position = argv.index(word, start) if word in argv[start:] else len(argv)
        if position > where:
            break
        owner, start = parser, position + 1
    return owner


# import name -> (package, the pyproject extra that installs it)
OPTIONAL_EXTRAS = {"lm_eval": ("lm-eval", "eval"), "gguf": ("gguf", "gguf"), "selenium": ("selenium", "dev")}


def command_of(argv: list[str]) -> str | None:
    """The subcommand an argument list invokes: its first word that is not a flag (None: none, e.g. --help)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The `stemlm` parser. With `argv`, only the subcommand it invokes is built in full (its module imported);
    the others are listed by their summaries alone. Without, every subcommand is built."""
    parser = OneLineParser(prog="stemlm", description="STEM transformers: train, run, edit and inspect.")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks instead of one-line errors")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = None if argv is None else command_of(argv)
    wanted = ALIASES.get(wanted, wanted)
    for name, summary in SUBCOMMANDS.items():
        if argv is None or name == wanted:
            importlib.import_module(f"stemlm.cli.{name.replace('-', '_')}").register(subparsers)
        else:
            aliases = [alias for alias, target in ALIASES.items() if target == name]
            subparsers.add_parser(name, help=summary, aliases=aliases)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("stemlm: interrupted", file=sys.stderr)
        return 130
    except ImportError as exc:  # an optional extra that is not installed: name it, not a traceback
        top = (exc.name or "").split(".")[0]
        if top not in OPTIONAL_EXTRAS or args.debug:
            raise
        package, extra = OPTIONAL_EXTRAS[top]
        print(f"stemlm {args.command}: error: this needs {package}: pip install 'stemlm[{extra}]'", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`stemlm info --json | head`): not an error; silence the flush at exit too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (ValueError, OSError, KeyError, RuntimeError) as exc:  # user-facing problems; bugs surface with --debug
        if args.debug:
            raise
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"stemlm {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
