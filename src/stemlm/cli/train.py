"""`stemlm train`: train a model (default: the `tiny` STEM preset on the embedded corpus + European capitals).

    stemlm train --out runs/tiny                              # the defaults: about 5 minutes on 2 idle cores
    stemlm train --preset tiny-dense --steps 200 --out runs/dense
    stemlm train --ffn stem --ffn-layers 1,3 --set model.hidden_size=128 train.eval_every=50
    stemlm train --data notes/ --tokenizer gpt2 --batch-size 4 --grad-accum 4
    stemlm train --resume runs/dense --steps 400               # continue (bitwise on CPU)
    stemlm train --init-from runs/retrofit/checkpoint --steps 100
    python -m stemlm train ...                                # the same command

Progress goes to stderr; at the end the accounting summary, held-out loss and a sample continuation go to
stdout (`--json`: one JSON object instead). Every flag of a setting is declared on its field, with its help, section
and choices (`TrainConfig` in stemlm.train.config, `RunRequest` in stemlm.train.setup; see stemlm.flags); this
module adds the command's own flags (launch, sample, output), and `--set model.<field>=V train.<field>=V` reaches
every model and training field.
"""

from __future__ import annotations

import argparse
import os

from stemlm.cli.common import add_field_flags, add_json_flag, print_json
from stemlm.errors import StemlmError
from stemlm.train.config import SECTIONS, TrainConfig
from stemlm.train.setup import RunRequest

DEFAULT_SAMPLE_PROMPT = "The king"
NUMBER_METAVARS = {"int": "N", "float": "X"}  # a number's value in the help, where its setting names none


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        usage="%(prog)s [options]  (the common ones first, by group below)",
        help="train a model (default: tiny STEM on the embedded corpus)",
        description=__doc__.split("\n\n")[0],
        epilog="examples:\n" + __doc__.split("\n\n")[1],  # the docstring's example commands
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    groups = {section: parser.add_argument_group(title) for section, title in SECTIONS.items()}
    add_launch_flags(groups["parallelism"])
    add_field_flags(groups, TrainConfig, metavars=NUMBER_METAVARS)
    add_field_flags(groups, RunRequest, metavars=NUMBER_METAVARS)
    groups["model"].add_argument(
        "--set",
        dest="overrides",
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="override any field: model.<field>=V or train.<field>=V (e.g. model.hidden_size=128)",
    )
    output = groups["checkpointing"]
    output.add_argument(
        "--sample-prompt",
        metavar="TEXT",
        default=DEFAULT_SAMPLE_PROMPT,
        help=f"prompt of the sample generation printed at the end (default {DEFAULT_SAMPLE_PROMPT!r})",
    )
    output.add_argument(
        "--sample-tokens", type=int, default=40, metavar="N", help="tokens of the final sample; 0 skips it"
    )
    output.add_argument("--no-progress", action="store_true", help="no progress bar (eval lines still go to stderr)")
    add_json_flag(output)
    parser.set_defaults(func=run, train_parser=parser)  # the parser rebuilds the workers' command (--nproc)


def add_launch_flags(group) -> None:
    """--nproc, --nnodes and --rdzv-endpoint: how many processes start (stemlm.train.parallel.launch)."""
    group.add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="train with N processes (torch.distributed under torchrun: one per GPU, or sharing the CPU cores); "
        "--batch-size stays the global micro-batch, split over the N processes (default 1)",
    )
    group.add_argument(
        "--nnodes",
        type=int,
        default=1,
        metavar="N",
        help="nodes of a multi-node run: start the same command on each (default 1)",
    )
    group.add_argument(
        "--rdzv-endpoint", metavar="HOST:PORT", help="with --nnodes > 1: the rendezvous address every node can reach"
    )


def run(args) -> int:
    from stemlm.train.parallel.workers import distributed_worker, rank_error
    from stemlm.train.report import render_report
    from stemlm.train.setup import run_training

    if args.sample_tokens < 0:
        raise StemlmError(f"--sample-tokens must be >= 0 (0 skips the sample), got {args.sample_tokens}")
    if args.allow_nonfinite and not args.resume:
        raise StemlmError("--allow-nonfinite applies to --resume (a checkpoint whose weights hold NaN or Inf)")
    worker = distributed_worker()  # a rank of torchrun or srun (it sets RANK)
    if not worker:
        from stemlm.train.parallel.launch import check_launch_flags

        check_launch_flags(args.nproc, args.nnodes, args.rdzv_endpoint, args.parallel)
    if (args.nproc > 1 or args.nnodes > 1) and "RANK" not in os.environ:
        return launch(args)
    try:
        report = run_training(RunRequest.from_args(args), args.sample_prompt, args.sample_tokens)
    except (ValueError, OSError, KeyError, RuntimeError) as exc:
        if not worker or args.debug:
            raise
        # The launcher shows rank 0's line and keeps the others' in the launch log (stemlm.cli.train_launch).
        raise StemlmError(rank_error(int(os.environ["RANK"]), exc)) from None
    if report is None:  # a rank other than 0 of a distributed run
        return 0
    if args.json:
        print_json(report)
    else:
        print(render_report(report))
    if report.get("stopped_by") and not distributed_worker():
        from stemlm.train.guard import exit_code

        return exit_code(report["stopped_by"])  # 130 / 143, as if the signal had ended the process
    return 0


def launch(args) -> int:
    """`--nproc N`: check everything a rank would check before it trains (`stemlm.train.preflight`), then start
    the ranks; a fresh run without --out gets its default folder chosen here, so every message can name it."""
    from stemlm.cli.train_launch import launch_workers
    from stemlm.train.preflight import preflight

    run_dir = preflight(RunRequest.from_args(args), args.nproc * args.nnodes, args.nproc)
    if not args.resume and args.out is None:
        args.out = str(run_dir)
    return launch_workers(args, run_dir)
