"""Helpers shared by subcommands: JSON output and config overrides from the command line."""

from __future__ import annotations

import json
import sys
from typing import Any


def print_json(obj: Any) -> None:
    """Print exactly one JSON object on stdout (the `--json` contract of every reporting subcommand)."""
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
    sys.stdout.flush()


def add_json_flag(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
