"""Data parallelism and the other wrappings of a training model, applied from outside in torchtitan's order.

    net = parallelize(model, cfg, world, amp_dtype, materialise)   # the module whose forward trains
    with gradient_sync(net, last=k == grad_accum - 1):
        net(x, labels=y, ...).loss.backward()

`parallelize` applies activation checkpointing, then `torch.compile` per block, then DDP or FSDP2 (torchtitan's
`parallelize_fn` order: checkpointing and compile wrap the single-device blocks, and the data-parallel wrapper
goes last so it sees the blocks it syncs as they will run). The token tables are placed before it is called
(`stemlm.placement.base`): row-sharded tables have left the model's parameters, so DDP / FSDP2 never see
them. In a world of one process the model itself trains. On several ranks:
- `ddp`: the backbone replicated (`DistributedDataParallel`); its weights must exist before it copies rank 0's,
  so a meta-built model is materialised first;
- `fsdp`: `fully_shard` per decoder layer, then the root (a replicated table several layers share, first, as
  its own unit); under bf16 the weights are all-gathered and used in bf16
  and gradients reduced in fp32 into the fp32 master shards; materialised after sharding (only this rank's shards
  are allocated);
- with `--train tables` and nothing in the backbone that learns, no wrapper (DDP refuses a module without
  gradients); n-gram / memory tables stay replicated, their row-sparse gradients declared before DDP wraps.
`gradient_sync` lets DDP all-reduce on a step's last micro-batch only (`no_sync` before it); FSDP2 keeps its
default and reduce-scatters after every micro-batch. Tests: tests/train/parallel/test_train_dist.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from stemlm.errors import StemlmError
from stemlm.train.config import TrainConfig


def parallelize(
    model: nn.Module, cfg: TrainConfig, world: Any, amp_dtype: torch.dtype, materialise: Callable[[], None]
) -> nn.Module:
    """Wrap `model` for training in `world` (see the module docstring); `materialise()` allocates and fills a
    meta-built model's part on this rank (idempotent)."""
    if cfg.activation_checkpointing:
        from stemlm.train.memory import checkpoint_blocks

        checkpoint_blocks(model)
    if cfg.compile:
        from stemlm.train.compile import compile_blocks

        compile_blocks(model)
    if not world.distributed:
        return model
    if cfg.parallel != "fsdp":
        materialise()  # DDP copies rank 0's weights at construction: they must exist before it
    _declare_sparse_replicated_tables(model, cfg)
    if not any(p.requires_grad for p in model.parameters()):
        # `--train tables` with no adapter gates: nothing in the backbone learns, so there are no gradients to
        # average (DDP refuses such a module) and each rank keeps the whole frozen backbone.
        materialise()
        return model
    if cfg.parallel == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        bf16 = amp_dtype == torch.bfloat16
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        kwargs = {"mp_policy": policy} if policy is not None else {}
        for table in _tables_read_by_several_layers(model):
            # Its own unit, gathered whenever a layer calls it and kept until backward (the reference memory's
            # FSDP plan): inside its owner layer's unit the other layers would find it still sharded.
            fully_shard(table, mesh=world.mesh, reshard_after_forward=False, **kwargs)
        for layer in model.model.layers:
            fully_shard(layer, mesh=world.mesh, **kwargs)
        fully_shard(model, mesh=world.mesh, **kwargs)
        materialise()  # after sharding: only this rank's shards are allocated
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [world.device.index] if world.device.type == "cuda" else None
    # Gradients live in DDP's buckets (no second copy); the only buffers (RoPE frequencies) are computed
    # identically on every rank, so nothing is broadcast before each forward.
    return DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True, broadcast_buffers=False)


def _tables_read_by_several_layers(model: nn.Module) -> list[nn.Module]:
    """The replicated table modules (n-gram / memory) that layers share (`Table(..., owner=...)`), e.g. the one
    value table of `memory_variant="reference"`; the token tables, sharded apart, are never in the model here."""
    from stemlm.model.decoder import layer_modules
    from stemlm.model.kinds.registry import FAMILIES

    shared: dict[int, nn.Module] = {}
    for i, layer in enumerate(model.model.layers):
        for kind, _side, module in layer_modules(model.config, layer, i):
            for table in kind.tables:
                if FAMILIES[table.family].nproc == "replicated" and table.owner_of(model.config, i) != i:
                    held = getattr(module, table.attr)
                    shared[id(held)] = held
    return list(shared.values())


def _declare_sparse_replicated_tables(model: nn.Module, cfg: TrainConfig) -> None:
    """n-gram / memory tables stay replicated; their row-sparse gradients must be declared before DDP wraps the
    model (gloo all-reduces sparse gradients; FSDP2 shards dense tensors only)."""
    from stemlm.model.kinds.registry import FAMILIES
    from stemlm.placement.table_optim import use_sparse_table_grads

    replicated = [f for f in model.lookup_tables() if FAMILIES[f].nproc == "replicated"]
    if cfg.table_optim == "adamw" or not replicated:
        return
    if cfg.parallel == "fsdp":
        raise StemlmError(
            f"--table-optim {cfg.table_optim} with n-gram / memory tables needs --parallel ddp "
            "(FSDP2 cannot shard row-sparse gradients); or use --table-optim adamw"
        )
    use_sparse_table_grads(model)


def gradient_sync(net: nn.Module, last: bool):
    """The context of one micro-batch's forward and backward: DDP synchronises on the `last` one only."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(net, DistributedDataParallel) and not last:
        return net.no_sync()
    return contextlib.nullcontext()
