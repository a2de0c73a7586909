"""`stemlm train`: train a model (default: the `tiny` STEM preset on the embedded corpus + European capitals).

    stemlm train --out runs/tiny                              # the defaults: about 5 minutes on 2 idle cores
    stemlm train --preset tiny-dense --steps 200 --out runs/dense
    stemlm train --ffn stem --stem-layers 1,3 --set model.hidden_size=128 train.eval_every=50
    stemlm train --data notes/ --tokenizer gpt2 --batch-size 4 --grad-accum 4
    stemlm train --resume runs/dense --steps 400               # continue (bitwise on CPU)
    stemlm train --init-from runs/retrofit/checkpoint --steps 100
    python -m stemlm.train ...                                # the same command

Progress goes to stderr; at the end the accounting summary, held-out loss and a sample continuation go to
stdout (`--json`: one JSON object instead). Every flag maps onto a `TrainConfig` field (stemlm.train.config)
and `--set model.<field>=V train.<field>=V` reaches every model and training field.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from stemlm.choices import COMPUTE_DTYPES, DEVICES, PARALLEL_MODES
from stemlm.cli.common import add_json_flag, print_json
from stemlm.errors import StemlmError
from stemlm.model.config import FFN_KINDS
from stemlm.runtime import TRAINING_PLACEMENTS, placement_choices
from stemlm.train.config import TrainConfig

DEFAULT_SAMPLE_PROMPT = "The king"

GROUPS = {  # argument groups of `train --help`, the common ones first
    "model": "model",
    "data": "data",
    "optim": "optimisation",
    "eval": "evaluation, checkpoints and output",
    "tables": "lookup tables",
    "dist": "several processes (torch.distributed)",
    "advanced": "profiling and advanced",
}
# (flag, TrainConfig field, type, help; "{}" shows the field's default). None on the namespace = not given.
TRAIN_FLAGS = [
    ("--init-from", "init_from", str, "start from the weights (and tokenizer) of this model checkpoint folder"),
    ("--tokenizer", "tokenizer", str, "default | gpt2 | path to a tokenizer.json (default: the default one)"),
    ("--seq-len", "seq_len", int, "tokens per sequence (default {})"),
    ("--batch-size", "batch_size", int, "sequences per micro-batch (default {})"),
    ("--separator", "separator", str, "special token placed after every document (default {})"),
    ("--sampling", "sampling", str, "epoch, uniform, or auto: epoch for prepared shards, else uniform (default {})"),
    ("--prefetch", "prefetch", int, "micro-batches read ahead on a worker thread; 0: off (default {})"),
    (
        "--recipe",
        "recipe",
        str,
        "training rules: stemlm, or official (the official STEM code's; docs/recipe.md) (default {})",
    ),
    ("--steps", "steps", int, "optimizer steps (default {})"),
    ("--lr", "lr", float, "peak learning rate of the backbone (default {})"),
    ("--warmup", "warmup", int, "linear warm-up steps before the cosine decay (default 10%% of --steps)"),
    ("--grad-accum", "grad_accum", int, "micro-batches per optimizer step (default {})"),
    (
        "--weight-decay",
        "weight_decay",
        float,
        "AdamW weight decay of matrices; norms get none (--recipe official: they do) (default {})",
    ),
    (
        "--grad-clip",
        "grad_clip",
        float,
        "clip the global gradient norm (--recipe official: each optimizer's) to this value; 0 disables (default {})",
    ),
    ("--aux-loss-coef", "aux_loss_coef", float, "weight of the MoE auxiliary loss (default {})"),
    ("--seed", "seed", int, "seed of the model init and the data windows (default {})"),
    ("--train", "trainable", str, "parameters that learn: all, or tables (the backbone frozen) (default {})"),
    ("--out", "out", str, "run folder (default runs/<preset>-<ffn>-<timestamp>)"),
    ("--eval-every", "eval_every", int, "steps between held-out evaluations; 0: only at the end (default {})"),
    ("--eval-batches", "eval_batches", int, "held-out batches (of --batch-size windows) per evaluation (default {})"),
    ("--save-every", "save_every", int, "steps between checkpoints; 0: only at the end (default {})"),
    ("--save-minutes", "save_minutes", float, "also save every this many minutes; 0: off (default {})"),
    ("--keep-last", "keep_last", int, "checkpoints to keep (default {})"),
    (
        "--table-wd",
        "table_wd",
        float,
        "weight decay of the STEM tables (default {}; --recipe official: --weight-decay)",
    ),
    ("--dist-timeout", "dist_timeout", float, "with --nproc: seconds a rank waits for a stalled peer (default {})"),
    ("--threads", "threads", int, "CPU threads (default: all cores)"),
    ("--loss-chunk", "loss_chunk", int, "lm_head + loss this many tokens at a time (no full logits kept); 0: off"),
    ("--max-skipped", "max_skipped", int, "stop after this many non-finite steps in a row; 0: never (default {})"),
    ("--spike-factor", "spike_factor", float, "count a loss above this x the rolling median as a spike (default {})"),
    ("--spike-window", "spike_window", int, "steps in the rolling median of the spike check (default {})"),
]
# The argument group of each TRAIN_FLAGS flag (`register` adds the other flags to their groups by name).
FLAG_GROUPS = {
    "model": "--init-from",
    "data": "--tokenizer --seq-len --batch-size --separator --sampling --prefetch",
    "optim": "--recipe --steps --lr --warmup --grad-accum --weight-decay --grad-clip --aux-loss-coef --seed --train",
    "eval": "--out --eval-every --eval-batches --save-every --save-minutes --keep-last",
    "tables": "--table-wd",
    "dist": "--dist-timeout",
    "advanced": "--threads --loss-chunk --max-skipped --spike-factor --spike-window",
}
METAVARS = {
    "init_from": "CKPT",
    "tokenizer": "NAME",
    "separator": "TOKEN",
    "sampling": "MODE",
    "out": "DIR",
    "trainable": "WHAT",
    "recipe": "NAME",
}
GROUP_OF = {flag: group for group, flags in FLAG_GROUPS.items() for flag in flags.split()}


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        usage="%(prog)s [options]  (the common ones first, by group below)",
        help="train a model (default: tiny STEM on the embedded corpus)",
        description=__doc__.split("\n\n")[0],
        epilog="examples:\n" + __doc__.split("\n\n")[1],  # the docstring's example commands
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = {key: parser.add_argument_group(title) for key, title in GROUPS.items()}
    g["model"].add_argument(
        "--preset", metavar="NAME", help="model preset (default tiny); see `stemlm info --list-presets`"
    )
    g["model"].add_argument("--ffn", choices=FFN_KINDS, help="FFN kind of the selected layers (default: the preset's)")
    g["model"].add_argument(
        "--stem-layers", metavar="SPEC", help="layers with the --ffn kind: all, all-but-first, odd, every:K, 1,3,..."
    )
    g["model"].add_argument(
        "--fit-vocab",
        action="store_true",
        help="resize the model's vocab_size to the tokenizer (rounded up to 64); without it a --preset or "
        "model.vocab_size that does not fit the tokenizer is an error (without --preset the tiny default fits)",
    )
    g["model"].add_argument(
        "--set",
        dest="overrides",
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="override any field: model.<field>=V or train.<field>=V (e.g. model.hidden_size=128)",
    )
    g["data"].add_argument(
        "--data",
        nargs="+",
        metavar="PATH",
        help="text/markdown/jsonl files or folders (default: the embedded Shakespeare + Austen corpus)",
    )
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    g["tables"].add_argument(
        "--tables",
        choices=placement_choices(TRAINING_PLACEMENTS),
        metavar="{device,host}",
        help="where the STEM tables and their optimizer state live while training: device (default) or host "
        "(rows gathered to the device ahead of each step, row-sparse update on the host; see "
        "stemlm.train.tables.host)",
    )
    g["tables"].add_argument(
        "--table-optim",
        metavar="NAME",
        help="optimizer of the STEM tables: rowwise_adagrad (default) or lazy_adamw (row-sparse: touched rows "
        "only), or adamw (dense over whole tables, as the official code; the one --recipe official takes); see "
        "stemlm.train.tables.optim",
    )
    g["tables"].add_argument(
        "--table-lr",
        metavar="LR|xN",
        help=f"peak lr of the STEM tables: a number, or xN for N x --lr (default x{defaults['table_lr_scale']:g}; "
        "--recipe official: x1)",
    )
    g["dist"].add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="train with N processes (torch.distributed under torchrun: one per GPU, or sharing the CPU cores); "
        "--batch-size stays the global micro-batch, split over the N processes (default 1)",
    )
    g["dist"].add_argument(
        "--nnodes",
        type=int,
        default=1,
        metavar="N",
        help="nodes of a multi-node run: start the same command on each (default 1)",
    )
    g["dist"].add_argument(
        "--rdzv-endpoint", metavar="HOST:PORT", help="with --nnodes > 1: the rendezvous address every node can reach"
    )
    g["dist"].add_argument(
        "--parallel",
        choices=PARALLEL_MODES,
        help="with --nproc > 1: replicate the backbone (ddp) or shard it per layer (fsdp, FSDP2); "
        "STEM tables are always row-sharded (default ddp)",
    )
    for flag, field, kind, text in TRAIN_FLAGS:
        metavar = {int: "N", float: "X"}.get(kind) or METAVARS[field]
        g[GROUP_OF[flag]].add_argument(flag, dest=field, type=kind, metavar=metavar, help=text.format(defaults[field]))
    g["eval"].add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue this run from its newest checkpoint (or from the given checkpoint folder of a run)",
    )
    g["eval"].add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="with --resume: continue even when the checkpoint's weights hold NaN or Inf (refused by default)",
    )
    g["eval"].add_argument(
        "--sample-prompt",
        metavar="TEXT",
        default=DEFAULT_SAMPLE_PROMPT,
        help=f"prompt of the sample generation printed at the end (default {DEFAULT_SAMPLE_PROMPT!r})",
    )
    g["eval"].add_argument(
        "--sample-tokens", type=int, default=40, metavar="N", help="tokens of the final sample; 0 skips it"
    )
    g["eval"].add_argument("--no-progress", action="store_true", help="no progress bar (eval lines still go to stderr)")
    add_json_flag(g["eval"])
    adv = g["advanced"]
    adv.add_argument("--device", choices=DEVICES, help="device (default auto)")
    adv.add_argument(
        "--dtype",
        choices=COMPUTE_DTYPES,
        help="autocast dtype; weights stay fp32 (default auto: bf16 on CUDA, fp32 on CPU where bf16 measured slower)",
    )
    for flag, text in SWITCHES:
        adv.add_argument(flag, action="store_true", default=None, help=text)
    parser.set_defaults(func=run, train_parser=parser)  # the parser rebuilds the workers' command (--nproc)


SWITCHES = [  # TrainConfig's bool fields: None on the namespace = not given
    (
        "--activation-checkpointing",
        "recompute each decoder block's activations in backward (less memory, ~1 extra forward)",
    ),
    ("--compile", "torch.compile each decoder block (inductor)"),
    (
        "--profile",
        "torch.profiler over steps 3-5: traces for TensorBoard / Perfetto and an operator table in RUN/profile",
    ),
    (
        "--memory-snapshot",
        "record the CUDA allocator's history; RUN/profile/memory-rank<r>.pickle for pytorch.org/memory_viz",
    ),
]


def train_overrides(args) -> dict[str, Any]:
    """Training fields given on the command line (flags win over --set train.*)."""
    from stemlm.model.overrides import split_sections, typed_overrides
    from stemlm.train.config import table_lr_fields

    items = split_sections(args.overrides, ("model", "train"))["train"]
    changes = typed_overrides(TrainConfig, items, prefix="train.", label="training config key")
    for f in dataclasses.fields(TrainConfig):  # a flag's dest is its field; --table-lr is parsed below
        if f.name != "table_lr" and getattr(args, f.name, None) is not None:
            changes[f.name] = getattr(args, f.name)
    if args.table_lr is not None:
        changes.update(table_lr_fields(args.table_lr))
    return changes


def run_request(args):
    """The parsed flags as a `stemlm.train.setup.RunRequest`."""
    from stemlm.model.overrides import split_sections
    from stemlm.train.setup import RunRequest

    given = ("preset", "ffn", "stem_layers", "fit_vocab", "tokenizer", "resume", "init_from", "allow_nonfinite")
    model_sets = split_sections(args.overrides, ("model", "train"))["model"]
    return RunRequest(
        train_overrides(args),
        model_sets=model_sets,
        progress=not args.no_progress,
        **{k: getattr(args, k) for k in given},
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
        report = run_training(run_request(args), args.sample_prompt, args.sample_tokens)
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

    run_dir = preflight(run_request(args), args.nproc * args.nnodes, args.nproc)
    if not args.resume and args.out is None:
        args.out = str(run_dir)
    return launch_workers(args, run_dir)
