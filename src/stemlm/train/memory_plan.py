"""Per-rank training memory plan of a model config: what `stemlm info --memory` prints.

    stemlm info --preset paper-1b --nproc 8 --table-optim adamw --memory --json

The model is built on the meta device (no memory, well under a second for paper-1b), and every figure is
counted from its tensors as `stemlm train --nproc N` lays them out, on the most loaded rank:
- backbone (everything but the STEM/PLE token tables): replicated under DDP (fp32 weights, fp32 gradients as
  the bucket views, AdamW's two fp32 moments), or under FSDP2 each tensor split along dim 0 into N equal
  chunks of ceil(rows / N) rows (padded), weights, gradients and moments alike;
- token tables: row-sharded by `stemlm.placement.row_sharded` (rank r owns rows r, r + N, ...: ceil(V / N) rows
  on rank 0), fp32; their optimizer state as `stemlm.placement.table_optim` allocates it (adamw / lazy_adamw: two
  fp32 moments per entry, lazy_adamw also an int64 step per row; rowwise_adagrad: one fp32 sum per row);
  their gradient is sparse, at most min(shard rows, global micro-batch tokens) rows;
- activations: elements autograd saves per token for backward, counted for the kinds that declare
  `Kind.activation_elements` (dense and STEM layers) from the layer code (RMSNorm saves its input, 1/rms, the
  normalised input and its product with the gain: 3d + 1; RoPE cos and sin: 2 head_dim; attention q and output (2
  heads head_dim), keys and values (2 kv_heads head_dim with SDPA's enable_gqa, torch >= 2.5; else repeated to all
  heads), plus a log-sum-exp per head; SwiGLU gate, its SiLU, up (or the STEM rows) and the product: 4 d_ff), plus the
  final norm, the fp32
  logits (V per token, or none with a chunked loss, which holds `loss_chunk` x V transiently) and int64 ids
  and labels. With activation checkpointing a block keeps only its input (d) and one block's set (with
  RoPE's) is live again during its backward. tests/train/test_memory_plan.py measures these counts on real
  forwards (every tensor autograd saves, deduplicated by storage). Bytes are 4 per element (fp32
  activations, as on CPU); bf16 autocast stores most of them in 2 bytes, so on a GPU the activation figures
  are an upper bound.
- checkpoint: the model file (fp32, tables whole) and the optimizer state summed over ranks.
`render_memory` gives the lines `stemlm info --memory` prints.
"""

from __future__ import annotations

import math
from typing import Any

from stemlm.choices import PARALLEL_MODES, TABLE_OPTIMIZERS
from stemlm.errors import StemlmError
from stemlm.model.attention import SDPA_GQA
from stemlm.model.config import ModelConfig
from stemlm.model.kinds.registry import all_kinds, get_kind

FP32, INT64 = 4, 8
# Kinds whose layers' saved activations are modelled (they declare `Kind.activation_elements`).
MODELLED_KINDS = tuple(k.name for k in all_kinds() if k.activation_elements is not None)


def _sharded_numel(shape: tuple[int, ...], nproc: int) -> int:
    rest = math.prod(shape[1:])
    return math.ceil(shape[0] / nproc) * rest if shape else 1


def _table_optimizer_bytes(table_optim: str, rows: int, width: int, num_tables: int) -> int:
    if table_optim == "rowwise_adagrad":
        return rows * num_tables * FP32  # one running sum per row of each table
    steps = rows * num_tables * INT64 if table_optim == "lazy_adamw" else 0  # lazy_adamw: a step count per row
    return 2 * rows * width * FP32 + steps


def _block_elements(config: ModelConfig) -> tuple[list[int], int]:
    """(elements each block saves per token, the shared RoPE cos/sin per token)."""
    kinds = {k for i in range(config.num_hidden_layers) for k in config.layer_kinds(i)}
    if not kinds <= set(MODELLED_KINDS):
        raise StemlmError(f"activation memory is modelled for {', '.join(MODELLED_KINDS)} layers, not {sorted(kinds)}")
    d, heads, hd = config.hidden_size, config.num_attention_heads, config.head_size
    kv_heads = config.kv_heads if SDPA_GQA else heads
    shared = 2 * (3 * d + 1) + 2 * (heads + kv_heads) * hd + heads  # two norms, attention
    ffn = [get_kind(config.layer_ffn(i)).activation_elements(config) for i in range(config.num_hidden_layers)]
    return [shared + f for f in ffn], 2 * hd


def activation_elements_per_token(config: ModelConfig, *, loss_chunk: int = 0, checkpointing: bool = False) -> int:
    """Elements kept for backward per token after the forward (int64 ids and labels count 2 each)."""
    blocks, rope = _block_elements(config)
    d = config.hidden_size
    # Checkpointed blocks keep only their input; RoPE's cos/sin are then rebuilt inside the recomputed block.
    layers = config.num_hidden_layers * d if checkpointing else rope + sum(blocks)
    head = 3 * d + 1 + (0 if loss_chunk else config.vocab_size)
    return 2 + layers + head + 2


def recompute_elements_per_token(config: ModelConfig) -> int:
    """With activation checkpointing: elements of the one block whose activations backward rebuilds at a time."""
    blocks, rope = _block_elements(config)
    return max(blocks) + rope


def memory_plan(
    config: ModelConfig,
    *,
    nproc: int = 1,
    parallel: str = "ddp",
    table_optim: str = "adamw",
    seq_len: int = 2048,
    micro_batch: int = 1,
    loss_chunk: int = 0,
    activation_checkpointing: bool = False,
) -> dict[str, Any]:
    """Bytes per rank (the most loaded one) of weights, gradients, optimizer state and activations."""
    from stemlm.model import build_model

    if nproc < 1 or micro_batch < 1 or seq_len < 1 or loss_chunk < 0:
        raise StemlmError("nproc, micro_batch and seq_len must be positive and loss_chunk non-negative")
    if parallel not in PARALLEL_MODES:
        raise StemlmError(f"parallel must be ddp or fsdp, got {parallel!r}")
    if table_optim not in TABLE_OPTIMIZERS:
        raise StemlmError(f"table_optim must be one of {', '.join(TABLE_OPTIMIZERS)}, got {table_optim!r}")
    model = build_model(config, device="meta")
    tables = {id(t.weight): t.weight for t in model.token_tables().values()}
    backbone = [p for p in model.parameters() if id(p) not in tables]
    total_params = sum(p.numel() for p in model.parameters())
    shard = (lambda p: _sharded_numel(tuple(p.shape), nproc)) if parallel == "fsdp" else (lambda p: p.numel())
    backbone_local = sum(shard(p) for p in backbone)
    rows = math.ceil(config.vocab_size / nproc) if tables else 0
    width = sum(t.shape[1] for t in tables.values())
    table_state = _table_optimizer_bytes(table_optim, rows, width, len(tables))
    tokens = micro_batch * seq_len
    per_token, recompute = None, 0
    if {k for i in range(config.num_hidden_layers) for k in config.layer_kinds(i)} <= set(MODELLED_KINDS):
        per_token = activation_elements_per_token(config, loss_chunk=loss_chunk, checkpointing=activation_checkpointing)
        recompute = recompute_elements_per_token(config) if activation_checkpointing else 0
    plan = {
        "nproc": nproc,
        "parallel": parallel,
        "table_optim": table_optim,
        "micro_batch_tokens_per_rank": tokens,
        "parameters": {"total": total_params, "backbone": sum(p.numel() for p in backbone), "tables": total_params
                       - sum(p.numel() for p in backbone), "table_rows_per_rank": rows, "table_width_sum": width},
        "bytes_per_rank": {
            "backbone_weights": backbone_local * FP32,
            "backbone_grads": backbone_local * FP32,
            "backbone_optimizer": 2 * backbone_local * FP32,
            "table_shard": rows * width * FP32,
            "table_optimizer": table_state,
            "table_grads_max": min(rows, tokens * nproc) * (width * FP32 + INT64) if tables else 0,
            "activations": per_token * FP32 * tokens if per_token is not None else None,
            "activation_recompute": recompute * FP32 * tokens,
            "loss_chunk_logits": loss_chunk * config.vocab_size * (FP32 + 2) if loss_chunk else 0,
        },
        "activation_elements_per_token": per_token,
        "checkpoint_bytes": {
            "model_fp32": total_params * FP32,
            "optimizer_all_ranks": 2 * sum(p.numel() for p in backbone) * FP32
            + _table_optimizer_bytes(table_optim, config.vocab_size if tables else 0, width, len(tables)),
        },
    }  # fmt: skip
    plan["bytes_per_rank"]["total"] = sum(v for v in plan["bytes_per_rank"].values() if v is not None)
    return plan


def render_memory(m: dict[str, Any]) -> list[str]:
    """The lines `stemlm info --memory` prints for a `memory_plan` result."""
    from stemlm.model.accounting_report import human

    lines = [
        f"training memory per rank: {m['nproc']} ranks, {m['parallel']}, tables {m['table_optim']}, "
        f"{m['micro_batch_tokens_per_rank']:,} tokens per micro-batch (fp32 weights, grads, moments, activations)"
    ]
    for key, n in m["bytes_per_rank"].items():
        lines.append(f"  {key:<28}{'n/a' if n is None else human(n, 'B'):>16}")
    lines.append(f"  {'checkpoint model file':<28}{human(m['checkpoint_bytes']['model_fp32'], 'B'):>16}")
    lines.append(f"  {'checkpoint optimizer (all)':<28}{human(m['checkpoint_bytes']['optimizer_all_ranks'], 'B'):>16}")
    return lines
