"""Checkpoints of a multi-process run: weights and optimizer state as row/parameter shards, each rank its own.

    RUN/checkpoints/step-000123/         the layout of stemlm.checkpoint.sharded: config.json, tokenizer.json,
                                         trainer_state.json (rank 0) and dcp/shard-<rank+1>-model-0000f-of-00002
                                         .safetensors from every rank: f = 1 weights, f = 2 optimizer state

No tensor is gathered: each rank hands torch.distributed.checkpoint (DCP) its own pieces. FSDP2 parameters
and their moments are DTensor shards already; DDP's replicated backbone is split by tensor over the ranks
(each replica is staged and written by one rank); a token table, and its row optimizer state, is moved from
`ShardedTables`' strided layout (row r on rank r % N) to contiguous row blocks (an all_to_all: each rank ends
with 1/N of the rows, never the table), a DTensor with a Shard(0) placement, since DCP reshards by chunk
overlap and a strided layout is no chunk. The files are safetensors (DCP's HuggingFaceStorageWriter): no
pickled metadata exists to trust when loading.

Saving is asynchronous (`dcp.async_save` on a separate gloo group, so its collectives never interleave with
training's): the pieces are copied to host memory before `save` returns, the files are written by a
background thread while training continues, then rank 0 completes the folder in another thread (trainer
state, manifest of every rank's files, fsync, rename into place, latest.json, pruning: `AtomicFolder`). So a
checkpoint is either complete with its manifest or absent (a temporary folder that the next save removes),
and the previous ones are untouched until it is in place. The next save, and the end of `fit`, wait for it.

A loader with M ranks (DDP or FSDP2, tables on the device or on the host), or one process without a process
group, builds templates in its own layout from the files' headers, DCP reads the overlapping pieces, and
table rows go back to the strided layout: a checkpoint written by N ranks resumes on any M. A 1-process
checkpoint (model.safetensors + optimizer.safetensors) also resumes on M ranks.
Tests: `OMP_NUM_THREADS=1 python -m pytest tests/train/parallel/test_train_dist.py
tests/train/parallel/test_dist_checkpoint.py -q`.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from stemlm.checkpoint.folder import AtomicFolder, write_json, write_model_config
from stemlm.checkpoint.sharded import DCP_DIR, MODEL_PREFIX, OPTIM_PREFIX, is_sharded, sharded_metadata
from stemlm.errors import StemlmError
from stemlm.placement.comm import all_to_all_rows, exchange_counts
from stemlm.placement.row_sharded import ShardedTables
from stemlm.placement.table_optim import flatten_optimizer_state
from stemlm.train.state import (
    STATE_FORMAT,
    STATE_NAME,
    TRAIN_PRODUCER,
    _class_name,
    capture_rng,
    checkpoint_dir,
    drop_optimizer_state,
    load_optimizer_state,
    prune_checkpoints,
    read_trainer_state,
    write_latest,
)

DIST_KEY = "distributed"
SHARDED_FORMAT = "dcp-safetensors-v1"
WEIGHTS_FILE, OPTIMIZER_FILE = 1, 2  # DCP file index of a key: which of a rank's two files holds it


# ----- table rows: strided (training) <-> contiguous blocks (DCP) -----
def block_range(vocab_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) of `rank`'s block: torch.chunk sizes, as DTensor's Shard(0) splits a dimension."""
    size = -(-vocab_size // world_size)
    return min(vocab_size, rank * size), min(vocab_size, (rank + 1) * size)


def _exchange_device(tables: ShardedTables, like: torch.Tensor) -> torch.device:
    # Host shards (stemlm.placement.host_sharded) cross ranks through the rank's device: NCCL moves device
    # tensors only.
    return getattr(tables, "device", like.device)


def strided_to_blocks(local: torch.Tensor, tables: ShardedTables) -> torch.Tensor:
    """This rank's strided rows of a [V, ...] tensor -> this rank's contiguous block of it (collective)."""
    n, rank, vocab = tables.world_size, tables.rank, tables.vocab_size
    local = local.to(_exchange_device(tables, local))
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
    block = block.to(_exchange_device(tables, block))
    start, stop = block_range(tables.vocab_size, n, rank)
    owner = torch.arange(start, stop, device=block.device) % n
    order = torch.argsort(owner, stable=True)
    send = torch.bincount(owner, minlength=n)
    recv = exchange_counts(send, tables.group)
    # Blocks arrive in rank order, each ascending: the concatenation is this rank's ids in ascending order.
    return all_to_all_rows(block[order], send.tolist(), recv.tolist(), tables.group)


def _block_dtensor(block: torch.Tensor, rows: int, mesh) -> DTensor:
    shape = torch.Size((rows, *block.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(block, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)


def _empty_block(shape: torch.Size, dtype: torch.dtype, tables: ShardedTables, mesh, device) -> DTensor:
    start, stop = block_range(tables.vocab_size, tables.world_size, tables.rank)
    return _block_dtensor(torch.zeros((stop - start, *shape[1:]), dtype=dtype, device=device), shape[0], mesh)


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


# ----- the pieces of this rank -----
def backbone_state(model) -> dict[str, torch.Tensor]:
    """The model's own state (DTensor shards under FSDP2), a tied lm_head once (as the model files store it)."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def model_pieces(model, tables: ShardedTables | None, mesh) -> dict[str, torch.Tensor]:
    """This rank's part of every weight, keyed model/<HF name> (collective when there are tables)."""
    pieces = {f"{MODEL_PREFIX}{k}": v for k, v in backbone_state(model).items()}
    if tables is not None:
        for layer in tables.layers:
            block = strided_to_blocks(tables.shard(layer).detach(), tables)
            pieces[f"{MODEL_PREFIX}{tables.model_names[layer]}"] = _block_dtensor(block, tables.vocab_size, mesh)
    return pieces


def optimizer_pieces(
    optimizers: list[torch.optim.Optimizer], tables: ShardedTables | None, mesh
) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Every optimizer's state keyed optim/opt<k>.state.<i>.<name>, table rows as block DTensors; the metas."""
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
                value = _block_dtensor(strided_to_blocks(value, tables), tables.vocab_size, mesh)
            tensors[f"{OPTIM_PREFIX}{key}"] = value
    return tensors, metas


def _spread_replicas(pieces: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each replicated tensor (DDP's backbone and its moments) from one rank only, round-robin over sorted keys.

    DCP would write a replica once anyway, but `async_save` first copies every tensor it is given to host memory:
    handing each rank 1/N of the replicas makes that copy 1/N of the backbone instead of all of it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    replicas = sorted(key for key, value in pieces.items() if not isinstance(value, DTensor))
    owner = {key: i % world for i, key in enumerate(replicas)}
    return {key: value for key, value in pieces.items() if owner.get(key, rank) == rank}


# ----- save -----
class ShardedSaver:
    """Asynchronous sharded checkpoints of one rank's `Trainer` (see the module docstring)."""

    def __init__(self, timeout_s: float) -> None:
        from datetime import timedelta

        # DCP's planning collectives run in a background thread: on their own group, never on training's.
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.future = None
        self.finisher: threading.Thread | None = None
        self.error: BaseException | None = None

    def save(self, trainer) -> Path:
        """Start writing RUN/checkpoints/step-<step>/ (collective); it is in place once `wait` returns."""
        self.wait()
        main = dist.get_rank() == 0
        target = checkpoint_dir(trainer.run_dir, trainer.step)
        shards, mesh = trainer.tables.row_shards, trainer.world.mesh
        pieces = model_pieces(trainer.model, shards, mesh)
        optim, metas = optimizer_pieces(trainer.optimizers, shards, mesh)
        info = {"world_size": dist.get_world_size(), "parallel": trainer.cfg.parallel, "format": SHARDED_FORMAT}
        payload = {**trainer.state(), "format": STATE_FORMAT, "step": trainer.step, "optimizers": metas}
        payload.update(rng=capture_rng(), **{DIST_KEY: info})
        # Every key of every rank (DCP's coordinator hands its mapping to all): taken before the replicas are spread.
        mapping = dict.fromkeys(pieces, WEIGHTS_FILE) | dict.fromkeys(optim, OPTIMIZER_FILE)
        pieces, optim = _spread_replicas(pieces), _spread_replicas(optim)
        folder = AtomicFolder(target, producer=TRAIN_PRODUCER, owned=True) if main else None
        where = [str(folder.__enter__()) if main else None]
        dist.broadcast_object_list(where, src=0)  # the temporary folder every rank writes into
        tmp = Path(where[0])
        writer = dcp.HuggingFaceStorageWriter(str(tmp / DCP_DIR), fqn_to_index_mapping=mapping, save_distributed=True)
        try:
            # Returns once every piece is copied to host memory; the files are written in the background.
            self.future = dcp.async_save({**pieces, **optim}, storage_writer=writer, process_group=self.group)
        except BaseException:
            if main:
                folder.__exit__(*_raised())
            raise
        if main:
            write_model_config(trainer.config, tmp, trainer.tokenizer)
            cfg = trainer.cfg
            job = (folder, tmp, payload, Path(trainer.run_dir), trainer.step, cfg.keep_last, cfg.keep_optimizer_state)
            self.finisher = threading.Thread(target=self._finish, args=job, name="stemlm-checkpoint", daemon=True)
            self.finisher.start()
        return target

    def _finish(self, folder, tmp, payload, run_dir, step, keep_last, keep_optimizer_state) -> None:
        try:
            self.future.result()  # on rank 0: every rank's files are written (DCP's finish step gathers them)
            write_json(tmp / STATE_NAME, payload)
        except BaseException as exc:
            self.error = exc
            try:
                folder.__exit__(type(exc), exc, exc.__traceback__)  # removes the temporary folder
            except StemlmError:
                pass
            return
        try:
            folder.__exit__(None, None, None)  # manifest, fsync, rename into place
            write_latest(run_dir, step)
            prune_checkpoints(run_dir, keep_last, written=step)
            if keep_optimizer_state == "newest":
                drop_optimizer_state(run_dir, keep=checkpoint_dir(run_dir, step))
        except BaseException as exc:
            self.error = exc

    def load_optimizers(self, trainer, ckpt: Path, state: dict[str, Any]) -> None:
        """The checkpoint's optimizer state (written by any number of ranks) into this rank's part (collective)."""
        load_optimizers(trainer.optimizers, ckpt, state, tables=trainer.tables.row_shards, mesh=trainer.world.mesh)

    def wait(self) -> None:
        """Block until the pending save (if any) is written and in place; raise its error."""
        future, finisher, self.future, self.finisher = self.future, self.finisher, None, None
        if finisher is not None:
            finisher.join()
        elif future is not None:
            try:
                future.result()
            except BaseException as exc:
                self.error = exc
        error, self.error = self.error, None
        if error is not None:
            if isinstance(error, StemlmError):
                raise error
            raise StemlmError(f"writing a checkpoint failed: {_describe(error)}") from None


def _describe(error) -> str:
    """One line for a save's error: DCP's CheckpointException carries one exception per failing rank."""
    if isinstance(error, tuple):  # CheckpointException.failures values: (exception, stack summary)
        error = error[0]
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {rank}: {_describe(exc)}" for rank, exc in sorted(failures.items()))
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _raised():
    return sys.exc_info()


# ----- load -----
def check_sharded_resume(ckpt: Path, state: dict[str, Any]) -> None:
    info = state.get(DIST_KEY, {})
    if info.get("format") != SHARDED_FORMAT or not is_sharded(ckpt):
        raise StemlmError(
            f"{ckpt} was written by an older stemlm --nproc run (pickled DCP metadata, which is never loaded); "
            f"resuming it is not supported: start from its weights with --init-from {ckpt}"
        )


def load_model_pieces(model, tables: ShardedTables | None, mesh, ckpt: Path) -> None:
    """Read a sharded checkpoint's weights into this rank's materialised model and table shards (collective)."""
    reader, metadata = sharded_metadata(ckpt)
    saved = {
        k.removeprefix(MODEL_PREFIX): m for k, m in metadata.state_dict_metadata.items() if k.startswith(MODEL_PREFIX)
    }
    template = {f"{MODEL_PREFIX}{k}": v for k, v in backbone_state(model).items()}
    blocks = {}
    if tables is not None:
        for layer in tables.layers:
            shard = tables.shard(layer)
            shape = torch.Size((tables.vocab_size, shard.shape[1]))
            device = _exchange_device(tables, shard)
            blocks[layer] = _empty_block(shape, shard.dtype, tables, mesh, device)
            template[f"{MODEL_PREFIX}{tables.model_names[layer]}"] = blocks[layer]
    expected = {k.removeprefix(MODEL_PREFIX): tuple(v.shape) for k, v in template.items()}
    got = {k: tuple(m.size) for k, m in saved.items()}
    if expected != got:
        diff = sorted(set(expected) ^ set(got)) or [k for k in sorted(expected) if expected[k] != got[k]]
        name = diff[0]
        saved_shape = list(got[name]) if name in got else "absent"
        model_shape = list(expected[name]) if name in expected else "absent"
        raise StemlmError(
            f"{ckpt}: its weights do not fit this model (first difference: {name}, saved {saved_shape}, "
            f"model {model_shape})"
        )
    try:
        dcp.load(template, storage_reader=reader)
    except (OSError, RuntimeError, ValueError) as exc:
        raise StemlmError(f"cannot read {ckpt / DCP_DIR} ({type(exc).__name__}: {exc})") from None
    with torch.no_grad():
        for layer, block in blocks.items():
            tables.shard(layer).copy_(blocks_to_strided(block.to_local(), tables))


def _template(key: str, meta, params: dict[str, torch.Tensor], tables: ShardedTables | None, mesh) -> torch.Tensor:
    """An empty tensor in this process's layout for a saved optimizer tensor of global shape `meta.size`."""
    shape, dtype = meta.size, meta.properties.dtype
    param = _param_of(key, params)
    if _is_table_row_state(param, shape, tables):
        return _empty_block(shape, dtype, tables, mesh, _exchange_device(tables, param))
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

    Handles sharded checkpoints of any world size (in a distributed run, or in one process without a process
    group) and 1-process checkpoints (optimizer.safetensors) into a distributed run.
    """
    params = _indexed_params(optimizers)
    if DIST_KEY not in state:
        _, tensors = read_trainer_state(ckpt)
        tensors = {key: _shard_full(key, t, params, tables) for key, t in sorted(tensors.items())}
        load_optimizer_state(optimizers, tensors, state["optimizers"], ckpt)
        return
    check_sharded_resume(ckpt, state)
    reader, metadata = sharded_metadata(ckpt)
    saved = {
        k.removeprefix(OPTIM_PREFIX): m for k, m in metadata.state_dict_metadata.items() if k.startswith(OPTIM_PREFIX)
    }
    if not saved:
        raise StemlmError(
            f"{ckpt} holds no optimizer state to resume from: only a run's newest checkpoint keeps it (train with "
            f"--set train.keep_optimizer_state=all to keep it in every one); resume from the newest checkpoint, "
            f"or start from these weights with --init-from {ckpt}"
        )
    template = {
        f"{OPTIM_PREFIX}{key}": _template(key, meta, params, tables, mesh) for key, meta in sorted(saved.items())
    }
    single = not (dist.is_available() and dist.is_initialized())  # a plain Trainer resuming: DCP reads every piece
    if single:
        from stemlm.checkpoint.sharded import load_pieces

        load_pieces(template, reader)
    else:
        try:
            dcp.load(template, storage_reader=reader)
        except (OSError, RuntimeError, ValueError) as exc:
            raise StemlmError(f"cannot read {ckpt / DCP_DIR} ({type(exc).__name__}: {exc})") from None
    tensors = {}
    for key, value in sorted(template.items()):
        key = key.removeprefix(OPTIM_PREFIX)
        if _is_table_row_state(_param_of(key, params), value.shape, tables):
            value = blocks_to_strided(value.to_local(), tables).to(_param_of(key, params).device)
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
