"""The accounting of a config as text: the table `stemlm info` prints, the preset list, and a check on the meta model.

`render_summary(config, summary)` formats `stemlm.model.accounting.summarize` (parameters by component, forward
FLOPs per token, decode bytes, the STEM saving and, for a paper preset, the paper's figures beside ours);
`context_length` picks and checks the length the figures are counted at; `preset_rows()` sizes every named
preset; `verify_on_meta` builds the model on the meta device and checks that its parameter count equals the
arithmetic. `human` writes a count or a quantity with its SI prefix.
"""

from __future__ import annotations

from typing import Any

from stemlm.errors import StemlmError
from stemlm.model.accounting import active_parameters, total_parameters
from stemlm.model.config import ModelConfig
from stemlm.model.presets import get_preset, list_presets

DEFAULT_SEQ_LEN = 2048  # the context length of `stemlm info` unless --seq-len says otherwise


def context_length(config: ModelConfig, seq_len: int | None = None) -> int:
    """The context length the figures are counted at: `seq_len` (checked against the model's maximum), else
    DEFAULT_SEQ_LEN or max_position_embeddings if smaller."""
    if seq_len is not None and seq_len < 1:
        raise StemlmError(f"--seq-len must be a positive integer, got {seq_len}")
    seq_len = seq_len or min(DEFAULT_SEQ_LEN, config.max_position_embeddings)
    if seq_len > config.max_position_embeddings:
        raise StemlmError(
            f"--seq-len {seq_len} exceeds max_position_embeddings={config.max_position_embeddings} "
            f"(raise it with --set max_position_embeddings={seq_len})"
        )
    return seq_len


def preset_rows() -> list[dict[str, Any]]:
    """Name, FFN kind, depth, width, total and active (backbone) parameters of every named preset."""
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
    return rows


def render_presets(rows: list[dict[str, Any]]) -> str:
    """The table `stemlm info --list-presets` prints for `preset_rows()`."""
    lines = [f"{'preset':<24}{'ffn':<10}{'layers':>7}{'d':>6}{'total':>10}{'active':>10}"]
    for r in rows:
        lines.append(
            f"{r['name']:<24}{r['ffn']:<10}{r['layers']:>7}{r['hidden_size']:>6}"
            f"{human(r['total']):>10}{human(r['active_backbone']):>10}"
        )
    return "\n".join(lines)


def verify_on_meta(config: ModelConfig) -> int:
    """Build the model on the meta device (no memory) and check its parameter count against the accounting."""
    from stemlm.model import build_model  # imports torch; only needed here

    built = build_model(config, device="meta").num_parameters()
    if built != total_parameters(config):
        raise RuntimeError(f"accounting says {total_parameters(config)} parameters, the meta model has {built}")
    return built


def human(n: float, unit: str = "") -> str:
    """6.67B (a count) or, with a unit, 2.30 GB / 2.44 GFLOPs."""
    scales = ("T", "G", "M", "k") if unit else ("T", "B", "M", "k")
    for scale, suffix in zip((1e12, 1e9, 1e6, 1e3), scales, strict=True):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{' ' if unit else ''}{suffix}{unit}"
    return f"{n:.0f}{' ' if unit else ''}{unit}"


def render_summary(config: ModelConfig, s: dict[str, Any]) -> str:
    """The readable table of `summarize(config, ...)` (with "model" naming the source), as `stemlm info` prints it."""
    p, f, dec = s["parameters"], s["flops"], s["decode"]
    special = ",".join(map(str, s["special_layers"])) or "none"
    lines = [
        f"{s['model']}: ffn {config.ffn} in layers [{special}] of {config.num_hidden_layers}; d {config.hidden_size}, "
        f"d_ff {config.intermediate_size}, heads {config.num_attention_heads}/{config.kv_heads} x {config.head_size}, "
        f"vocab {config.vocab_size}, {'tied' if config.tie_word_embeddings else 'untied'} embeddings",
        *(
            f"{kind} beside the FFN in layers [{','.join(map(str, layers))}]"
            for kind, layers in s.get("beside", {}).items()
        ),
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
    return "\n".join(lines)


def render_paper(c: dict[str, Any]) -> list[str]:
    """The lines comparing our counts with the paper's figures for a paper preset."""
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
