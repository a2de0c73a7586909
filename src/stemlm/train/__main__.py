"""`python -m stemlm.train [flags]`: the same command as `stemlm train [flags]` (see stemlm.cli.train)."""

import sys

from stemlm.cli.main import main

if __name__ == "__main__":
    args = sys.argv[1:]
    debug = ["--debug"] if "--debug" in args else []  # a flag of the top-level parser, before the subcommand
    sys.exit(main([*debug, "train", *[a for a in args if a != "--debug"]]))
