"""The report `stemlm train` ends with: run figures, accounting, compute share, held-out loss, fact recall, sample.

`final_report(trainer, result, ...)` adds to `Trainer.fit`'s result the run folder's size, what the held-out loss
was measured on, the accounting summary (`stemlm.model.accounting`), the compute share of the measured matmul
peak in wall and in CPU time (`stemlm.train.throughput`), the exact greedy recall of the mixed-in facts
(`stemlm.evaluation.recall`) and a greedy sample; `render_report` turns it into the lines printed (`--json`
prints the dict itself).
"""

from __future__ import annotations

from typing import Any

from stemlm.errors import StemlmError
from stemlm.evaluation.recall import fact_recall
from stemlm.placement.registry import placement_named


def final_report(trainer, result: dict[str, Any], sample_prompt: str, sample_tokens: int) -> dict[str, Any]:
    """The final metrics plus accounting figures, fact recall and a greedy continuation of `sample_prompt`
    (`sample_tokens` tokens; 0 or a stopped run: none)."""
    from stemlm.checkpoint.runs import folder_bytes

    report = dict(result)
    report["run_dir_bytes"] = folder_bytes(result["run_dir"])
    cfg = trainer.cfg
    held = trainer.heldout_data
    report["heldout_eval"] = {  # what the held-out loss was measured on (stemlm eval ppl defaults to this window)
        "window": cfg.seq_len,
        "tokens": min(cfg.eval_batches * cfg.batch_size, held.num_eval_windows(cfg.seq_len)) * cfg.seq_len
        if held
        else 0,
    }
    try:
        from stemlm.model.accounting import TABLE_COMPONENTS, summarize

        summary = summarize(trainer.config, trainer.cfg.seq_len)
        report["accounting"] = {
            "ffn": summary["ffn"],
            "special_layers": summary["special_layers"],
            "parameters_total": summary["parameters"]["total"],
            "parameters_active_per_token": summary["parameters"]["active_backbone"],
            "table_parameters": sum(summary["parameters"]["components"].get(k, 0) for k in TABLE_COMPONENTS),
            "training_flops_per_token": summary["flops"]["training_per_token"],
        }
    except ImportError:
        report["accounting"] = None
    if result.get("tokens_per_s"):
        from stemlm.train.throughput import training_throughput

        cfg, world = trainer.cfg, result.get("world_size", 1)
        report["compute"] = training_throughput(
            trainer.config,
            cfg.seq_len,
            result["tokens_per_s"],
            result.get("cpu_tokens_per_s"),
            cfg.batch_size * cfg.seq_len // world,
            trainer.device,
            trainer.amp_dtype,
            world,
        )
    if trainer.cfg.data is None and trainer.cfg.fact_fraction > 0:
        report["facts"] = trained_fact_recall(trainer)
    if sample_tokens > 0 and not result.get("stopped_by"):  # a stopped run exits without the sample
        report["sample"] = {"prompt": sample_prompt, "completion": sample(trainer, sample_prompt, sample_tokens)}
    return report


def trained_fact_recall(trainer) -> dict[str, Any]:
    """Exact greedy recall of the mixed-in facts, on the trained templates and on held-out phrasings."""
    cfg = trainer.cfg
    trainer.model.eval()
    recall = fact_recall(trainer.model, trainer.tokenizer, tuple(cfg.fact_relations), region=cfg.fact_selection())
    out: dict[str, Any] = {
        "region": cfg.fact_region,
        "countries": list(cfg.fact_countries),
        "relations": list(cfg.fact_relations),
    }
    for split in ("train", "heldout"):
        out[f"{split}_templates"] = {"prompts": recall[split]["prompts"], "recall": recall[split]["recall"]}
    return out


def sample(trainer, prompt: str, tokens: int) -> str:
    """The greedy continuation of `prompt` by the trained model (`tokens` new tokens)."""
    from stemlm.inference.generate import generate

    ids = trainer.tokenizer.encode(prompt).ids
    if not ids:
        raise StemlmError("--sample-prompt encodes to no tokens; pass some text")
    trainer.model.eval()
    new = generate(trainer.model, ids, tokens, greedy=True, **trainer.inference_rows())
    return trainer.tokenizer.decode(new)


def render_report(r: dict[str, Any]) -> str:
    """The text `stemlm train` prints at the end: one line per part of `final_report`."""
    lines = [
        f"run {r['run_dir']}: {r['steps']} steps, {r['tokens_seen']:,} tokens, "
        f"{r['tokens_per_s']:,.0f} tokens/s ({r['autocast_dtype']} on {r['device']}), {r['wall_s']:.0f} s"
    ]
    a = r.get("accounting")
    if a:
        layers = ",".join(map(str, a["special_layers"])) or "none"
        lines.append(
            f"model: ffn {a['ffn']} in layers [{layers}]; {a['parameters_total']:,} parameters "
            f"({a['table_parameters']:,} in tables), {a['parameters_active_per_token']:,} active per token, "
            f"{a['training_flops_per_token'] / 1e6:.1f} MFLOPs/token to train, "
            f"{a['training_flops_per_token'] * r['tokens_seen'] / 1e12:.2f} TFLOP over its {r['tokens_seen']:,} tokens"
        )
    c = r.get("compute")
    if c:
        line = (
            f"compute: {c['model_gflops_per_s']:,.1f} model GFLOP/s = {c['peak_share']:.0%} of "
            f"{c['matmul_peak_gflops_per_s']:,.1f} GFLOP/s (wall clock)"
        )
        if "cpu_peak_share" in c:
            line += (
                f", {c['model_gflops_per_cpu_s']:,.1f} per CPU-second = {c['cpu_peak_share']:.0%} of "
                f"{c['matmul_peak_gflops_per_cpu_s']:,.1f} (process CPU time)"
            )
        lines.append(line + "; peaks: the best plain matmul at the model's shapes, measured now in the same clock")
    h = r.get("heldout_eval") or {}
    held = (
        "n/a"
        if r["heldout_loss"] is None
        else f"{r['heldout_loss']:.4f} ({h['tokens']:,} tokens, window {h['window']})"
    )
    lines.append(
        f"train loss {r['train_loss']:.4f} | held-out loss {held} | skipped steps {r['skipped_steps']} | "
        f"loss spikes {r['loss_spikes']}"
    )
    placement = placement_named(r.get("placement", ""))
    if placement is not None:
        lines += placement.report_lines(r)
    if "facts" in r:
        f = r["facts"]
        where = f"{len(f['countries'])} countries" if f.get("countries") else f["region"]
        lines.append(
            f"facts ({', '.join(f['relations'])}, {where}): exact greedy recall "
            f"{f['train_templates']['recall']:.2f} on the {f['train_templates']['prompts']} trained prompts, "
            f"{f['heldout_templates']['recall']:.2f} on {f['heldout_templates']['prompts']} held-out phrasings"
        )
    lines.append(f"checkpoint: {r['checkpoint']} (run folder {r['run_dir_bytes'] / 1e6:.1f} MB)")
    if "sample" in r:
        lines.append(f"sample (greedy): {(r['sample']['prompt'] + r['sample']['completion']).rstrip()}")
    return "\n".join(lines)
