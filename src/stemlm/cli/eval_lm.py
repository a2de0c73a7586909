"""`stemlm eval lm CKPT`: run EleutherAI's lm-evaluation-harness (offline) on a checkpoint.

    stemlm eval lm runs/tiny                                   # the five shipped tasks (tag `stemlm`)
    stemlm eval lm runs/tiny --tasks stemlm_facts_capital,stemlm_cloze --limit 50 --json
    stemlm eval lm runs/tiny --include-path my_tasks/ --tasks my_task --out results.json

Tasks come from the shipped folder and any `--include-path` folders (lm-eval YAML; `dataset_path: json`
with `data_files` relative to the YAML works from any working directory). lm-eval imports and runs Python
that a task names (`!function module.fn`, from the YAML's folder): an include folder is code, so one that is
world-writable or owned by another user is refused unless `--allow-task-code`
(`stemlm.evaluation.task_folders`). Nothing is downloaded: `--builtin` also indexes lm-eval's own tasks, which
then only run if their datasets are already in the local Hugging Face cache. This module adds the `lm`
subcommand to the `stemlm eval` group.
"""

from __future__ import annotations

import json
import sys

from stemlm.cli.common import add_inference_flags, add_json_flag, arg_type, print_json
from stemlm.errors import StemlmError
from stemlm.evaluation.tasks import parse_limit


def register_eval(subparsers) -> None:
    parser = subparsers.add_parser(
        "lm",
        help="run lm-evaluation-harness tasks (offline)",
        description="Evaluate a checkpoint with EleutherAI's lm-evaluation-harness on local task files.",
    )
    parser.add_argument("checkpoint", metavar="CKPT", help="a checkpoint folder or a training run folder")
    parser.add_argument(
        "--tasks",
        metavar="T1,T2",
        help="comma-separated task names, tags or glob patterns (default: the shipped stemlm tasks)",
    )
    parser.add_argument(
        "--limit", type=arg_type(parse_limit), help="examples per task: an integer, or a fraction below 1"
    )
    parser.add_argument(
        "--include-path",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder of extra task YAMLs (repeatable); its tasks override shipped ones of the same name. "
        "lm-eval runs Python code a task names (!function), so a folder that is world-writable or not yours is "
        "refused unless --allow-task-code",
    )
    parser.add_argument(
        "--allow-task-code",
        action="store_true",
        help="accept --include-path folders others could write (their task files may run Python: review them)",
    )
    parser.add_argument("--num-fewshot", type=int, metavar="K", help="few-shot examples per prompt (default: task's)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per forward (default: 8)")
    parser.add_argument("--max-length", type=int, metavar="L", help="context window (default: the model's maximum)")
    parser.add_argument("--builtin", action="store_true", help="also index lm-eval's built-in tasks (cached data only)")
    parser.add_argument("--seed", type=int, default=0, help="seed for lm-eval's sampling and few-shot choice")
    add_inference_flags(parser)
    parser.add_argument("--no-progress", action="store_true", help="no request progress bars on stderr")
    parser.add_argument("--out", metavar="FILE", help="also write lm-eval's full results as JSON to FILE")
    parser.add_argument("--force", action="store_true", help="replace --out FILE if it exists")
    add_json_flag(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    from stemlm.checkpoint.safe_write import check_file_target, write_output_file
    from stemlm.evaluation.lm_eval_adapter import evaluate_checkpoint, render_task_report, results_summary, task_report

    if args.out:
        check_file_target(args.out, force=args.force)  # before the (long) evaluation
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    if args.tasks is not None and not tasks:
        raise StemlmError("--tasks is empty: name at least one task")
    from stemlm.inference.load import InferenceOptions

    lm_options = {k: getattr(args, k) for k in ("batch_size", "max_length")} | {"progress": not args.no_progress}
    eval_options = {k: getattr(args, k) for k in ("limit", "num_fewshot", "builtin", "seed", "allow_task_code")}
    results = evaluate_checkpoint(
        args.checkpoint, InferenceOptions.from_args(args), tasks, args.include_path, **lm_options, **eval_options
    )
    if args.out:
        write_output_file(args.out, json.dumps(results, indent=2, default=str), force=args.force)
    if args.json:
        print_json({"checkpoint": args.checkpoint, "limit": args.limit, **results_summary(results)})
        return 0
    print(render_task_report(task_report(results)))
    if args.out:
        print(f"full results: {args.out}", file=sys.stderr)
    return 0
