"""`stemlm eval <what>`: evaluation sub-commands, one registration function per entry of `EVAL_COMMANDS`.

    stemlm eval edits CKPT --records 50 --relation capital      # knowledge-editing metrics (stemlm.cli.edit)

To add `stemlm eval ppl|lm|niah|...`, write a module with `register(subparsers)` that adds ONE parser to the
given sub-command group (help on every flag, `set_defaults(func=...)`), and append "module:function" here.
"""

from __future__ import annotations

from stemlm.cli.common import register_group

# "module:function" entries; each function adds one `stemlm eval <name>` parser. Order = the help listing.
EVAL_COMMANDS = [
    "stemlm.cli.edit:register_eval",
    "stemlm.cli.eval_ppl:register_eval",
    "stemlm.cli.eval_lm:register_eval",
    "stemlm.cli.eval_niah:register_eval",
    "stemlm.cli.eval_niah:register_eval_data",
]


def register(subparsers) -> None:
    register_group(
        subparsers,
        "eval",
        EVAL_COMMANDS,
        help_text="evaluate a checkpoint (edits, ...)",
        description="Evaluation sub-commands; each writes a table, or one JSON object with --json.",
    )
