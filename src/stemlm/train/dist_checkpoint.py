"""Checkpoints of a multi-process run: the full model folder from rank 0, optimizer state through DCP.

    RUN/checkpoints/step-000123/
        config.json, model.safetensors, tokenizer.json   the whole model, tables unsharded, written by rank 0: the
                                                         same model folder a 1-process run writes, so `stemlm
                                                         generate/eval/convert` and `--init-from` read it as is
        trainer_state.json                               as in stemlm.train.state, plus "distributed":
                                                         {"world_size", "parallel", "optimizer_state": "dcp"}
        dcp/                                             optimizer state, torch.distributed.checkpoint format,
                                                         every rank writing its own part

Weights are gathered (a full state dict) because every reader of a checkpoint expects the model folder. The
optimizer state, two to three times the weights, stays sharded: DCP writes each FSDP2 DTensor shard as it is,
and the table optimizer's row state is first moved from `ShardedTables`' strided layout (row r on rank r % N)
to contiguous row blocks (a DTensor with a Shard(0) placement), since DCP reshards by chunk overlap and a
strided layout is no chunk. A loader with M ranks (or one process without a process group) builds a template
in its own layout from the checkpoint's metadata, DCP reads the overlapping pieces, and table rows go back
to the strided layout: a checkpoint written by N ranks resumes on any M, DDP or FSDP2. `load_optimizers`
also reads a 1-process checkpoint (optimizer.safetensors) into a distributed run. Cost: a save gathers the
backbone onto rank 0 and every table onto every rank (`ShardedTables.full_tables`, an all_gather), so each
rank briefly holds the full tables once per checkpoint.
Tests: `OMP_NUM_THREADS=1 python -m pytest tests/dist/test_train_dist.py -q`.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from stemlm.checkpoint import AtomicFolder, write_json, write_model_files
from stemlm.dist.comm import all_to_all_rows, exchange_counts
from stemlm.dist.sharded_tables import ShardedTables
from stemlm.errors import StemlmError
from stemlm.model import build_model
from stemlm.train.state import (
    STATE_FORMAT,
    STATE_NAME,
    TRAIN_PRODUCER,
    _class_name,
    capture_rng,
    checkpoint_dir,
    load_optimizer_state,
    prune_checkpoints,
    read_trainer_state,
    write_latest,
)
from stemlm.train.table_optim import flatten_optimizer_state

DCP_DIR = "dcp"
DIST_KEY = "distributed"


# ----- table rows: strided (training) <-> contiguous blocks (DCP) -----
def block_range(vocab_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) of `rank`'s block: torch.chunk sizes, as DTensor's Shard(0) splits a dimension."""
    size = -(-vocab_size // world_size)
    return min(vocab_size, rank * size), min(vocab_size, (rank + 1) * size)


def strided_to_blocks(local: torch.Tensor, tables: ShardedTables) -> torch.Tensor:
    """This rank's strided rows of a [V, ...] tensor -> this rank's contiguous block of it (collective)."""
    n, rank, vocab = tables.world_size, tables.rank, tables.vocab_size
    size = -(-vocab // n)
    dest = tables.global_ids().to(local.device) // size  # ascending ids: already grouped by destination
    send = torch.bincount(dest, minlength=n)
    recv = exchange_counts(send, tables.group)
    got = all_to_all_rows(local, send.tolist(), recv.tolist(), tables.group)
    start, stop = block_range(vocab, n, rank)
    # From source s come the block's ids congruent to s mod n, ascending.
    order = torch.cat([torch.arange(start + (s - start) % n, stop, n) for s in range(n)]) - start
    block = local.new_empty((stop - start, *local.shape[1:]))
    block[order.to(local.device)] = got
    return block


def blocks_to_strided(block: torch.Tensor, tables: ShardedTables) -> torch.Tensor:
    """Inverse of `strided_to_blocks` (collective)."""
    n, rank = tables.world_size, tables.rank
    start, stop = block_range(tables.vocab_size, n, rank)
    owner = torch.arange(start, stop, device=block.device) % n
    order = torch.argsort(owner, stable=True)
    send = torch.bincount(owner, minlength=n)
    recv = exchange_counts(send, tables.group)
    # Blocks arrive in rank order, each ascending: the concatenation is this rank's ids in ascending order.
    return all_to_all_rows(block[order], send.tolist(), recv.tolist(), tables.group)


def _table_block_dtensor(local: torch.Tensor, tables: ShardedTables, mesh) -> DTensor:
    block = strided_to_blocks(local, tables)
    shape = torch.Size((tables.vocab_size, *local.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(block, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)


def _is_table_shard(param: torch.Tensor | None, tables: ShardedTables | None) -> bool:
    return tables is not None and param is not None and any(param is p for p in tables.parameters())


def _is_table_row_state(param: torch.Tensor | None, shape: torch.Size, tables: ShardedTables | None) -> bool:
    # Row state of a table shard (moments, per-row steps, row accumulators) has the table's V rows in a
    # checkpoint; a scalar step count does not.
    return _is_table_shard(param, tables) and len(shape) >= 1 and shape[0] == tables.vocab_size


def _indexed_params(optimizers: list[torch.optim.Optimizer]) -> dict[str, torch.Tensor]:
    """Parameters by key `opt<k>.state.<i>`, numbered as optimizer.state_dict() numbers them."""
    out = {}
    for k, opt in enumerate(optimizers):
        params = [p for group in opt.param_groups for p in group["params"]]
        out.update({f"opt{k}.state.{i}": p for i, p in enumerate(params)})
    return out


def _param_of(key: str, params: dict[str, torch.Tensor]) -> torch.Tensor | None:
    return params.get(key.rsplit(".", 1)[0])


# ----- save -----
def full_model_state(model, tables: ShardedTables | None, fsdp: bool) -> dict[str, torch.Tensor]:
    """The whole model's state dict with unsharded tables on rank 0, {} on the others (collective)."""
    rank = dist.get_rank()
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # full_state_dict + cpu_offload: gathered layer by layer onto rank 0's CPU only.
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()} if rank == 0 else {}
    if tables is not None:
        for layer, full in tables.full_tables().items():
            if rank == 0:
                state[tables.model_names[layer]] = full.cpu()
    return state


def optimizer_state_for_dcp(
    optimizers: list[torch.optim.Optimizer], tables: ShardedTables | None, mesh
) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Every optimizer's state keyed opt<k>.state.<i>.<name>, table rows as block DTensors; and the metas."""
    params = _indexed_params(optimizers)
    tensors: dict[str, torch.Tensor] = {}
    metas = []
    for k, opt in enumerate(optimizers):
        flat, meta = flatten_optimizer_state(opt.state_dict())
        metas.append({**meta, "class": _class_name(opt)})
        for name in sorted(flat):  # the same order on every rank: the conversions below are collective
            key, value = f"opt{k}.{name}", flat[name]
            param = _param_of(key, params)
            if _is_table_shard(param, tables) and value.dim() >= 1 and value.shape[0] == param.shape[0]:
                value = _table_block_dtensor(value, tables, mesh)
            tensors[key] = value
    return tensors, metas


def write_model_folder(config, state: dict[str, torch.Tensor], folder: Path, tokenizer) -> None:
    """The model-core folder (config.json, weights, tokenizer) from a full state dict."""
    shell = build_model(config, device="meta")
    shell.load_state_dict(state, strict=True, assign=True)
    write_model_files(shell, folder, tokenizer)


def save_distributed_checkpoint(trainer) -> Path:
    """Write RUN/checkpoints/step-<step>/ from every rank, atomically; rank 0 points latest.json at it."""
    main = dist.get_rank() == 0
    target = checkpoint_dir(trainer.run_dir, trainer.step)
    model_state = full_model_state(trainer.model, trainer.tables, trainer.cfg.parallel == "fsdp")
    tensors, metas = optimizer_state_for_dcp(trainer.optimizers, trainer.tables, trainer.mesh)
    info = {"world_size": dist.get_world_size(), "parallel": trainer.cfg.parallel, "optimizer_state": DCP_DIR}
    payload = {**trainer.state(), "format": STATE_FORMAT, "step": trainer.step, "optimizers": metas}
    payload.update(rng=capture_rng(), **{DIST_KEY: info})

    def write(tmp: Path | None) -> None:
        where = [str(tmp) if tmp is not None else None]
        dist.broadcast_object_list(where, src=0)  # the temporary folder every rank writes into
        dcp.save(tensors, checkpoint_id=Path(where[0]) / DCP_DIR)  # returns once every rank's part is written
        if main:
            write_model_folder(trainer.config, model_state, tmp, trainer.tokenizer)
            write_json(tmp / STATE_NAME, payload)

    if main:
        with AtomicFolder(target, producer=TRAIN_PRODUCER, owned=True) as tmp:
            write(tmp)
        write_latest(Path(trainer.run_dir), trainer.step)
        prune_checkpoints(Path(trainer.run_dir), trainer.cfg.keep_last, written=trainer.step)
    else:
        write(None)
    dist.barrier()  # nobody moves on before the checkpoint is in place
    return target


# ----- load -----
def _template(key: str, meta, params: dict[str, torch.Tensor], tables: ShardedTables | None, mesh) -> torch.Tensor:
    """An empty tensor in this process's layout for a saved optimizer tensor of global shape `meta.size`."""
    shape, dtype = meta.size, meta.properties.dtype
    param = _param_of(key, params)
    if _is_table_row_state(param, shape, tables):
        start, stop = block_range(tables.vocab_size, tables.world_size, tables.rank)
        local = torch.zeros((stop - start, *shape[1:]), dtype=dtype, device=param.device)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)
    if isinstance(param, DTensor) and tuple(param.shape) == tuple(shape):
        return torch.zeros_like(param, dtype=dtype)  # the parameter's own sharding (FSDP2)
    device = param.device if param is not None and not isinstance(param, DTensor) else "cpu"
    return torch.zeros(shape, dtype=dtype, device=device)


def load_optimizers(
    optimizers: list[torch.optim.Optimizer],
    ckpt: Path,
    state: dict[str, Any],
    tables: ShardedTables | None = None,
    mesh=None,
) -> None:
    """Load a checkpoint's optimizer state into this process's optimizers, resharding as needed.

    Handles DCP checkpoints of any world size (in a distributed run or in one process without a process
    group) and 1-process checkpoints (optimizer.safetensors) into a distributed run.
    """
    params = _indexed_params(optimizers)
    if DIST_KEY not in state:
        _, tensors = read_trainer_state(ckpt)
        tensors = {key: _shard_full(key, t, params, tables) for key, t in sorted(tensors.items())}
        load_optimizer_state(optimizers, tensors, state["optimizers"], ckpt)
        return
    reader = dcp.FileSystemReader(str(ckpt / DCP_DIR))
    try:
        saved = reader.read_metadata().state_dict_metadata
    except (OSError, ValueError, RuntimeError) as exc:
        raise StemlmError(f"{ckpt / DCP_DIR} is missing or corrupt ({exc})") from None
    template = {key: _template(key, meta, params, tables, mesh) for key, meta in sorted(saved.items())}
    single = not (dist.is_available() and dist.is_initialized())  # a plain Trainer resuming: DCP reads every piece
    with warnings.catch_warnings():
        # torch warns that it "assumes the intent is to load in a single process" even when told so (2.13).
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(template, storage_reader=reader, no_dist=single)
    tensors = {}
    for key, value in sorted(template.items()):
        if _is_table_row_state(_param_of(key, params), value.shape, tables):
            value = blocks_to_strided(value.to_local(), tables)
        tensors[key] = value
    load_optimizer_state(optimizers, tensors, state["optimizers"], ckpt)


def _shard_full(key: str, value: torch.Tensor, params: dict[str, torch.Tensor], tables) -> torch.Tensor:
    """A full optimizer tensor from a 1-process checkpoint, cut to this rank's part of its parameter."""
    param = _param_of(key, params)
    if _is_table_row_state(param, value.shape, tables):
        return tables.local_rows_of(value).clone()
    if isinstance(param, DTensor) and tuple(param.shape) == tuple(value.shape):
        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
    return value
