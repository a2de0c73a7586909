"""Command-line pieces shared by subcommands: JSON output, the flags of a dataclass's settings (`add_field_flags`;
`given_fields`, from stemlm.flags, reads them back), the table placement flags, command groups, and `arg_type`,
which turns a library parser (one that raises StemlmError) into an argparse type.

CLI modules import only this module from `stemlm.cli` (the dispatcher `main` imports them all); anything
else they share (loading checkpoints, decoding text) lives in the library, e.g. `stemlm.checkpoint.runs`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import sys
from collections.abc import Callable
from typing import Any

from stemlm.choices import CACHE_POLICIES, COMPUTE_DTYPES, TABLE_DTYPES
from stemlm.errors import StemlmError
from stemlm.flags import UNSET, Setting, help_text, settings


def print_json(obj: Any) -> None:
    """Print exactly one JSON object on stdout (the `--json` contract of every reporting subcommand)."""
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
    sys.stdout.flush()


def arg_type(parse):
    """An argparse `type` from a library parser that raises StemlmError: its message becomes argparse's."""

    def convert(text: str):
        try:
            return parse(text)
        except StemlmError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def add_field_flags(
    target,
    cls: type,
    *,
    describe: Callable[[dataclasses.Field, Setting], str] | None = None,
    metavars: dict[str, str] | None = None,
) -> None:
    """One flag per setting of the dataclass `cls` (stemlm.flags), in field order: `target` is a parser, or a dict
    of argument groups by section. Each flag's dest is its field and its default None (not given: `given_fields`);
    `describe(field, setting)` writes the help (default: `stemlm.flags.help_text`), and `metavars` names a
    number's value where the setting does not (e.g. {"int": "N", "float": "X"})."""
    for flag, f, spec in settings(cls):
        help = describe(f, spec) if describe else help_text(cls, f, spec)
        if spec.aliases:
            help += f" (old name: {', '.join(spec.aliases)})"
        kw: dict[str, Any] = {"dest": f.name, "default": None, "help": help}
        if spec.const is not UNSET:
            kw.update(action="store_const", const=spec.const)
        else:
            base = str(f.type).split("|")[0].strip()  # "int" of "int | None"
            kw["metavar"] = spec.metavar or (metavars or {}).get(base)
            if spec.append or spec.many:  # the values keep their text
                kw.update(action="append" if spec.append else "store", nargs="+" if spec.many else None)
            else:
                kw.update(type=arg_type(functools.partial(parse_setting, f, spec)), choices=spec.one_of)
        group = target[spec.section] if isinstance(target, dict) else target
        group.add_argument(flag, **kw)
        for alias in spec.aliases:  # the same setting under its old name, listed once in the flag's help
            group.add_argument(alias, **{**kw, "help": argparse.SUPPRESS})


def parse_setting(f: dataclasses.Field, spec: Setting, text: str) -> Any:
    """A flag's value from its text: the setting's own parser, else the field's annotation."""
    from stemlm.model.overrides import parse_value

    return spec.parse(text) if spec.parse else parse_value(text, str(f.type), f.name, "option")


def add_json_flag(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")


def add_table_flags(p) -> None:
    """The table placement, cache and table dtype flags of every command that runs a checkpoint
    (`stemlm.inference.load.InferenceOptions`)."""
    from stemlm.placement.registry import INFERENCE, tables_values  # here: the placements import torch

    p.add_argument(
        "--tables",
        choices=tables_values(INFERENCE),
        metavar="{" + ",".join(tables_values(INFERENCE)) + "}",
        default="resident",
        help="where the STEM tables live: on the device (default), in host memory, or memory-mapped "
        "from the checkpoint file; host and mmap serve rows through a device cache",
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--cache-rows",
        type=int,
        metavar="N",
        help="device cache of N token rows (all table layers of a token share a row; "
        "default with --tables host/mmap: 20%% of the vocabulary)",
    )
    size.add_argument(
        "--cache-fraction", type=float, metavar="F", help="device cache of this fraction of the vocabulary, e.g. 0.2"
    )
    p.add_argument(
        "--cache-policy",
        choices=CACHE_POLICIES,
        default="lfu",
        help="cache replacement policy (default lfu, least-recent as tie-break)",
    )
    p.add_argument(
        "--table-dtype",
        choices=TABLE_DTYPES,
        help="the format the table rows are kept in: fp32, bf16, or int8 with one scale per row and layer "
        "(dequantised when gathered); default: as the checkpoint stores them. host: converted on load; mmap: must "
        "match the file (stemlm convert CKPT --table-dtype stores it so); resident: rows rounded, no memory saved",
    )


def add_inference_flags(p) -> None:
    """--device, --dtype and the table flags: the options of `stemlm.inference.load.load_inference`."""
    p.add_argument("--device", default="cpu", help="torch device to run on, e.g. cpu or cuda (default cpu)")
    p.add_argument(
        "--dtype",
        choices=COMPUTE_DTYPES,
        default="auto",
        help="compute dtype (autocast; weights stay as loaded); auto: bf16 on a CUDA device that supports it, "
        "else fp32 (default auto)",
    )
    add_table_flags(p)


def register_group(subparsers, name: str, entries: list, help_text: str, description: str):
    """A command whose sub-commands come from `entries` ("module:function", or a function), each adding one
    parser to the group; prints its help when no sub-command is given."""
    parser = subparsers.add_parser(name, help=help_text, description=description)
    group = parser.add_subparsers(dest=f"{name}_command", metavar="SUBCOMMAND")
    for entry in entries:
        if isinstance(entry, str):
            module, function = entry.split(":")
            entry = getattr(importlib.import_module(module), function)
        entry(group)

    def show_help(args) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=show_help)
    return parser
