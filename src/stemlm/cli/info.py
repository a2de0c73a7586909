"""`stemlm info`: parameters, FLOPs and decode memory traffic of a preset or a config, without building it.

    stemlm info --preset paper-1b-counts          # readable table, with the paper's figures beside ours
    stemlm info --preset tiny --seq-len 512 --set intermediate_size=1024 --json
    stemlm info --config runs/x/checkpoint       # a checkpoint folder or a config.json file
    stemlm info --list-presets

Every figure comes from `stemlm.model.accounting` (arithmetic on the config; see its docstring for the counting
conventions). `--verify` also builds the model on the meta device (no memory) and checks the parameter count.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stemlm.cli.common import add_json_flag, print_json
from stemlm.errors import StemlmError
from stemlm.model.accounting import ATTENTION_MODES, DTYPE_BYTES, active_parameters, summarize, total_parameters
from stemlm.model.config import FFN_KINDS, ModelConfig
from stemlm.model.presets import get_preset, list_presets, preset_source

DEFAULT_SEQ_LEN = 2048


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
        help="override a config field, e.g. --set stem_layers=odd (repeatable; 'model.' prefix ok)",
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
    group.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp", help="backbone layout (default ddp)")
    group.add_argument("--table-optim", default="adamw", help="table optimizer of the planned run (default adamw)")
    group.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per micro-batch (default 1)")
    group.add_argument("--loss-chunk", type=int, default=0, help="planned --loss-chunk (default 0: full logits)")
    group.add_argument(
        "--activation-checkpointing", action="store_true", help="plan with per-block activation checkpointing"
    )


def load_config_file(path: str) -> ModelConfig:
    """A config from a checkpoint or run folder, or a JSON file (a model config, or {"model": {...}})."""
    p = Path(path)
    if p.is_dir() and (p / "run_config.json").is_file() and not (p / "config.json").is_file():
        p = p / "run_config.json"  # a training run folder: its resolved config (model section nested)
    elif p.is_dir():
        from stemlm.checkpoint.runs import resolve_checkpoint

        p = resolve_checkpoint(p) / "config.json"
    if not p.is_file():
        raise StemlmError(f"{path} is neither a config.json file nor a folder holding one")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StemlmError(f"{p} is not valid JSON ({exc})") from None
    if isinstance(data, dict) and isinstance(data.get("model"), dict) and "hidden_size" not in data:
        data = data["model"]  # a run config with the model section nested
    if not isinstance(data, dict):
        raise StemlmError(f"{p} does not hold a JSON object")
    try:
        return ModelConfig.from_dict(data)
    except TypeError as exc:
        raise StemlmError(f"{p} is not a stemlm model config ({exc})") from None


def resolve(args) -> tuple[str, ModelConfig]:
    if args.preset:
        name, config = args.preset, get_preset(args.preset)
    elif args.config:
        name, config = args.config, load_config_file(args.config)
    else:
        raise StemlmError("give --preset NAME, --config PATH or --list-presets")
    if args.ffn:
        config = config.replace(ffn=args.ffn)
    if args.overrides:
        config = config.with_overrides(args.overrides)
    return name, config


def verify_on_meta(config: ModelConfig) -> int:
    from stemlm.model import build_model  # imports torch; only needed here

    built = build_model(config, device="meta").num_parameters()
    if built != total_parameters(config):
        raise RuntimeError(f"accounting says {total_parameters(config)} parameters, the meta model has {built}")
    return built


def run(args) -> int:
    if args.list_presets:
        return list_all(args.json)
    name, config = resolve(args)
    if args.seq_len is not None and args.seq_len < 1:
        raise StemlmError(f"--seq-len must be a positive integer, got {args.seq_len}")
    seq_len = args.seq_len or min(DEFAULT_SEQ_LEN, config.max_position_embeddings)
    if seq_len > config.max_position_embeddings:
        raise StemlmError(
            f"--seq-len {seq_len} exceeds max_position_embeddings={config.max_position_embeddings} "
            f"(raise it with --set max_position_embeddings={seq_len})"
        )
    summary = {"model": name, **summarize(config, seq_len, args.attention, args.dtype)}
    if args.preset:
        summary["source"] = preset_source(args.preset)
    if args.verify:
        summary["verified_parameters_on_meta"] = verify_on_meta(config)
    if args.memory:
        from stemlm.train.memory_plan import memory_plan

        summary["memory"] = memory_plan(
            config,
            nproc=args.nproc,
            parallel=args.parallel,
            table_optim=args.table_optim,
            seq_len=seq_len,
            micro_batch=args.micro_batch,
            loss_chunk=args.loss_chunk,
            activation_checkpointing=args.activation_checkpointing,
        )
    if args.json:
        print_json(summary)
    else:
        print(render(config, summary))
        if args.verify:
            print(
                f"verified: the model built on the meta device has {summary['verified_parameters_on_meta']:,} "
                "parameters, equal to the count above"
            )
    return 0


def list_all(as_json: bool) -> int:
    rows = []
    for name in list_presets():
        c = get_preset(name)
        rows.append(
            {
                "name": name,
                "ffn": c.ffn,
                "layers": c.num_hidden_layers,
                "hidden_size": c.hidden_size,
                "total": total_parameters(c),
                "active_backbone": active_parameters(c)["backbone"],
            }
        )
    if as_json:
        print_json({"presets": rows})
    else:
        print(f"{'preset':<24}{'ffn':<10}{'layers':>7}{'d':>6}{'total':>10}{'active':>10}")
        for r in rows:
            print(
                f"{r['name']:<24}{r['ffn']:<10}{r['layers']:>7}{r['hidden_size']:>6}"
                f"{human(r['total']):>10}{human(r['active_backbone']):>10}"
            )
    return 0


# ----------------------------------------------------------------------------------------------------------
# the readable table
# ----------------------------------------------------------------------------------------------------------
def human(n: float, unit: str = "") -> str:
    """6.67B (a count) or, with a unit, 2.30 GB / 2.44 GFLOPs."""
    scales = ("T", "G", "M", "k") if unit else ("T", "B", "M", "k")
    for scale, suffix in zip((1e12, 1e9, 1e6, 1e3), scales, strict=True):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{' ' if unit else ''}{suffix}{unit}"
    return f"{n:.0f}{' ' if unit else ''}{unit}"


def render(config: ModelConfig, s: dict[str, Any]) -> str:
    p, f, dec = s["parameters"], s["flops"], s["decode"]
    special = ",".join(map(str, s["special_layers"])) or "none"
    lines = [
        f"{s['model']}: ffn {config.ffn} in layers [{special}] of {config.num_hidden_layers}; d {config.hidden_size}, "
        f"d_ff {config.intermediate_size}, heads {config.num_attention_heads}/{config.kv_heads} x {config.head_size}, "
        f"vocab {config.vocab_size}, {'tied' if config.tie_word_embeddings else 'untied'} embeddings",
        *([f"source: {s['source']}"] if "source" in s else []),
        "",
        "parameters",
    ]
    lines += [f"  {k:<28}{v:>16,}  {100 * v / p['total']:5.1f}%" for k, v in p["components"].items() if v]
    lines += [
        f"  {'total':<28}{p['total']:>16,}  ({human(p['total'])})",
        f"  {'active / token (backbone)':<28}{p['active_backbone']:>16,}  ({human(p['active_backbone'])}; "
        "no tables, embedding in full)",
        f"  {'active incl. looked-up rows':<28}{p['active_with_rows']:>16,}  (+{p['rows_per_token']:,} table entries)",
        "",
        f"forward FLOPs per token at L={s['seq_len']} ({s['attention']} attention; 2 x MACs, lookups are free)",
    ]
    forward = f["forward_per_token"]
    lines += [f"  {k:<28}{human(v, 'FLOPs'):>16}" for k, v in forward.items() if v and k != "total"]
    training = human(f["training_per_token"], "FLOPs")
    lines.append(f"  {'total':<28}{human(forward['total'], 'FLOPs'):>16}  (training ~3x: {training})")
    if config.ffn != "dense":
        lines.append(f"  {'saving vs dense twin':<28}{100 * f['saving_vs_dense_twin']:>15.2f}%")
    lines += [
        "",
        f"decode, batch 1, context {dec['context_len']}, {s['dtype']}",
        f"  {'FLOPs / token':<28}{human(dec['flops_per_token'], 'FLOPs'):>16}",
        f"  {'parameters read':<28}{dec['params_touched']:>16,}",
    ]
    for label, key in (("weight bytes", "weights"), ("KV cache bytes", "kv_cache")):
        n = dec["bytes_per_token"][key]
        lines.append(f"  {label:<28}{n:>16,}  ({human(n, 'B')})")
    if "stem" in s:
        st = s["stem"]
        lines += [
            "",
            "STEM layer vs its dense twin (forward FLOPs)",
            f"  {'exact saving (this config)':<28}{st['layer_saving_fraction']:>16.4f}",
            f"  {'seed d_ff/(4d+2L+3d_ff)':<28}{st['seed_saving_fraction']:>16.4f}  (MHA, full attention scores)",
        ]
    if "paper" in s:
        lines += ["", *render_paper(s["paper"])]
    if "memory" in s:
        lines += ["", *render_memory(s["memory"])]
    return "\n".join(lines)


def render_memory(m: dict[str, Any]) -> list[str]:
    lines = [
        f"training memory per rank: {m['nproc']} ranks, {m['parallel']}, tables {m['table_optim']}, "
        f"{m['micro_batch_tokens_per_rank']:,} tokens per micro-batch (fp32 weights, grads, moments, activations)"
    ]
    for key, n in m["bytes_per_rank"].items():
        lines.append(f"  {key:<28}{'n/a' if n is None else human(n, 'B'):>16}")
    lines.append(f"  {'checkpoint model file':<28}{human(m['checkpoint_bytes']['model_fp32'], 'B'):>16}")
    lines.append(f"  {'checkpoint optimizer (all)':<28}{human(m['checkpoint_bytes']['optimizer_all_ranks'], 'B'):>16}")
    return lines


def render_paper(c: dict[str, Any]) -> list[str]:
    paper, ours, conv = c["paper"], c["ours"], c["paper_convention"]
    return [
        f"vs the paper ({c['preset']})          paper       ours   ours in the paper's convention",
        f"  total parameters          {paper['total_b']:>8.2f}B {ours['total'] / 1e9:>9.2f}B"
        f"   {conv['total'] / 1e9:.2f}B",
        f"  active parameters         {paper['active_b']:>8.2f}B {ours['active_backbone'] / 1e9:>9.2f}B",
        f"  GFLOPs / token            {paper['gflops_per_token']:>9.2f} {ours['gflops_per_token_matmuls_only']:>10.2f}"
        f"    {conv['gflops_per_token']:.2f}   (ours: matmuls only, without attention scores)",
        f"  why: {c['explanation']}",
    ]
