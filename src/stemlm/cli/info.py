"""`stemlm info`: parameters, FLOPs and decode memory traffic of a preset or a config, without building it.

    stemlm info --preset paper-1b-counts          # readable table, with the paper's figures beside ours
    stemlm info --preset tiny --seq-len 512 --set intermediate_size=1024 --json
    stemlm info --config runs/x/checkpoint       # a checkpoint folder or a config.json file
    stemlm info --list-presets

Every figure comes from `stemlm.model.accounting` (arithmetic on the config; see its docstring for the counting
conventions). `--verify` also builds the model on the meta device (no memory) and checks the parameter count.
"""

from __future__ import annotations

from stemlm.choices import PARALLEL_MODES
from stemlm.cli.common import add_json_flag, print_json
from stemlm.errors import StemlmError
from stemlm.model.accounting import ATTENTION_MODES, DTYPE_BYTES, summarize
from stemlm.model.accounting_report import DEFAULT_SEQ_LEN
from stemlm.model.config import FFN_KINDS
from stemlm.model.presets import preset_source


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "info",
        help="parameter, FLOP and memory accounting of a model config",
        description="Parameter, FLOP and decode-memory accounting of a model config, "
        "computed from the config alone (nothing is allocated).",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", metavar="NAME", help="a named preset (see --list-presets)")
    source.add_argument("--config", metavar="PATH", help="a config.json file or a checkpoint folder holding one")
    source.add_argument("--list-presets", action="store_true", help="list the presets with their sizes and exit")
    parser.add_argument("--ffn", choices=FFN_KINDS, help="FFN kind of the selected layers (default: the preset's)")
    parser.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override a config field, e.g. --set ffn_layers=odd (repeatable; 'model.' prefix ok)",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        metavar="L",
        help=f"context length for attention FLOPs and the KV cache "
        f"(default: {DEFAULT_SEQ_LEN} or max_position_embeddings if smaller)",
    )
    parser.add_argument(
        "--attention",
        choices=ATTENTION_MODES,
        default="causal",
        help="count attention scores over the causal half (default) or the full L x L matrix",
    )
    parser.add_argument(
        "--dtype",
        choices=list(DTYPE_BYTES),
        default="bf16",
        help="weight and KV-cache element type for decode bytes (default: bf16)",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="also build the model on the meta device and check the parameter count against it",
    )
    add_memory_flags(parser)
    add_json_flag(parser)
    parser.set_defaults(func=run)


def add_memory_flags(parser) -> None:
    group = parser.add_argument_group("training memory plan (--memory; stemlm.train.memory_plan)")
    group.add_argument("--memory", action="store_true", help="add the per-rank training memory plan")
    group.add_argument("--nproc", type=int, default=1, help="ranks of the planned run (default 1)")
    group.add_argument("--parallel", choices=PARALLEL_MODES, default="ddp", help="backbone layout (default ddp)")
    group.add_argument("--table-optim", default="adamw", help="table optimizer of the planned run (default adamw)")
    group.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per micro-batch (default 1)")
    group.add_argument(
        "--loss-chunk",
        type=int,
        default=None,
        help="planned --loss-chunk; 0: full logits (default: as stemlm train, chunks of 512 from V = 65536 up)",
    )
    group.add_argument(
        "--activation-checkpointing", action="store_true", help="plan with per-block activation checkpointing"
    )


def run(args) -> int:
    if args.list_presets:
        return list_all(args.json)
    from stemlm.checkpoint.runs import named_model_config

    if not (args.preset or args.config):
        raise StemlmError("give --preset NAME, --config PATH or --list-presets")
    name, config = named_model_config(args.preset, args.config, args.ffn, args.overrides)
    from stemlm.model.accounting_report import context_length

    seq_len = context_length(config, args.seq_len)
    summary = {"model": name, **summarize(config, seq_len, args.attention, args.dtype)}
    if args.preset:
        summary["source"] = preset_source(args.preset)
    if args.verify:
        from stemlm.model.accounting_report import verify_on_meta

        summary["verified_parameters_on_meta"] = verify_on_meta(config)
    if args.memory:
        from stemlm.train.memory import default_loss_chunk
        from stemlm.train.memory_plan import memory_plan

        planned = ("nproc", "parallel", "table_optim", "micro_batch", "activation_checkpointing")
        chunk = default_loss_chunk(config) if args.loss_chunk is None else args.loss_chunk
        summary["memory"] = memory_plan(
            config, seq_len=seq_len, loss_chunk=chunk, **{k: getattr(args, k) for k in planned}
        )
    if args.json:
        print_json(summary)
    else:
        from stemlm.model.accounting_report import render_summary

        text = render_summary(config, summary)
        if "memory" in summary:
            from stemlm.train.memory_plan import render_memory

            text += "\n\n" + "\n".join(render_memory(summary["memory"]))
        print(text)
        if args.verify:
            print(
                f"verified: the model built on the meta device has {summary['verified_parameters_on_meta']:,} "
                "parameters, equal to the count above"
            )
    return 0


def list_all(as_json: bool) -> int:
    from stemlm.model.accounting_report import preset_rows, render_presets

    rows = preset_rows()
    if as_json:
        print_json({"presets": rows})
    else:
        print(render_presets(rows))
    return 0
