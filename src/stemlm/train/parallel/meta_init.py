"""A multi-process run's model built on the meta device, each rank materialising and initialising its part only.

`stemlm train --nproc N` builds the model with no storage (meta device), shards it (token tables into row
shards, the backbone into FSDP2 shards or, under DDP, kept whole), then allocates only this rank's tensors
(`materialise`) and either fills them from a sharded checkpoint or initialises them here (`init_rank_part`).
No rank ever holds a whole table or, under FSDP2, the whole backbone.

The initial values equal `StemLM.init_weights` bitwise for the same seed: that draws every parameter in
turn from one CPU generator (`torch.randn(shape)`); here the same draws are made in row blocks of a multiple
of 16 rows, which consume the generator exactly as one call over the whole tensor does (CPU randn fills
16 values at a time), and each rank keeps the rows it owns (strided rows of a table, the FSDP2 shard's rows,
or all of them). So each rank still draws every value once (the same CPU time as before) but stores only
its own: memory per rank is its shards plus one block of at most `BLOCK_VALUES` values.
Tests: `OMP_NUM_THREADS=1 python -m pytest tests/train/test_dist_init.py -q`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from stemlm.model.kinds.registry import fill_value, init_draws

BLOCK_VALUES = 1 << 22  # values drawn per block (16 MiB of fp32)


def init_plan(model) -> list[tuple[str, tuple[int, ...], float | None]]:
    """(name, shape, std) of every parameter in `init_weights`' order; call on the meta model before sharding."""
    return [(name, tuple(param.shape), std) for name, param, std in model.init_specs()]


def materialise(model: nn.Module, tables, device: torch.device) -> None:
    """Allocate (uninitialised) this rank's tensors: the model's (after any FSDP2 sharding) and the table shards."""
    model.to_empty(device=device)
    if not isinstance(getattr(model.model.embed_tokens, "weight", None), DTensor):
        model.tie_weights()  # to_empty re-allocates per module; re-tie as build_model does (FSDP2 keeps one param)
    model.reset_buffers(device)
    if tables is not None:
        for key, shard in list(tables.shards.items()):
            if shard.is_meta:
                tables.shards[key] = nn.Parameter(torch.empty_like(shard, device=device))


def _row_blocks(rows: int, row_values: int) -> list[tuple[int, int]]:
    step = max(16, BLOCK_VALUES // max(1, row_values) // 16 * 16)  # a multiple of 16 rows: see the docstring
    bounds, start = [], 0
    while start < rows:
        stop = rows if rows - start < 2 * step else start + step  # no short last block
        bounds.append((start, stop))
        start = stop
    return bounds


def _draw(shape: tuple[int, ...], std: float, generator: torch.Generator, keep: Callable) -> None:
    """The draws of `init_draws(torch.randn(shape, generator), std)` (std: a normal's or a `Uniform`), handed
    to `keep(start, stop, values)` by rows."""
    if not shape:
        keep(0, 1, init_draws(torch.randn((), generator=generator, dtype=torch.float32), std))
        return
    row_values = 1
    for size in shape[1:]:
        row_values *= size
    for start, stop in _row_blocks(shape[0], row_values):
        draws = torch.randn((stop - start, *shape[1:]), generator=generator, dtype=torch.float32)
        keep(start, stop, init_draws(draws, std))


def _keep_strided(local: torch.Tensor, rank: int, world: int) -> Callable:
    def keep(start: int, stop: int, values: torch.Tensor) -> None:
        first = start + (rank - start) % world  # the first row of [start, stop) this rank owns
        if first < stop:
            mine = values[first - start :: world]
            local[first // world : first // world + mine.shape[0]] = mine.to(local.device, local.dtype)

    return keep


def _keep_block(local: torch.Tensor, offset: int) -> Callable:
    def keep(start: int, stop: int, values: torch.Tensor) -> None:
        if local.dim() == 0:
            local.copy_(values)
            return
        lo, hi = max(start, offset), min(stop, offset + local.shape[0])
        if lo < hi:
            local[lo - offset : hi - offset] = values[lo - start : hi - start].to(local.device, local.dtype)

    return keep


def _local_and_offset(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    if not isinstance(param, DTensor):
        return param, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), (offset[0] if offset else 0)


@torch.no_grad()
def init_rank_part(model: nn.Module, tables, plan: list[tuple[str, tuple[int, ...], float | None]], seed: int) -> None:
    """Initialise this rank's materialised tensors to the values `build_model(config, seed=seed)` gives them."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    params = dict(model.named_parameters())
    shards = {tables.model_names[i]: tables.shard(i) for i in tables.layers} if tables is not None else {}
    for name, shape, std in plan:
        if name in shards:
            local = shards[name].detach()
            keep = _keep_strided(local, tables.rank, tables.world_size)
        else:
            local, offset = _local_and_offset(params[name].detach())
            keep = _keep_block(local, offset)
        if (fill := fill_value(std)) is not None:
            local.fill_(fill)
        else:
            _draw(shape, std, generator, keep)


@torch.no_grad()
def load_rank_part(model: nn.Module, tables, plan: list[tuple[str, tuple[int, ...], float | None]], folder) -> None:
    """Fill this rank's materialised tensors from a model folder (--init-from, a 1-process checkpoint), reading
    only what it keeps: its FSDP2 rows, its table rows (read in row blocks, so never a whole table at once), or
    a whole replicated tensor. The checks are `stemlm.checkpoint.runs.from_pretrained`'s; values are cast to the model's
    fp32 masters."""
    from safetensors import SafetensorError, safe_open

    from stemlm.checkpoint.folder import weight_files
    from stemlm.errors import StemlmError

    expected = {name: shape for name, shape, _ in plan}
    params = dict(model.named_parameters())
    shards = {tables.model_names[i]: tables.shard(i) for i in tables.layers} if tables is not None else {}
    tied = model.config.tie_word_embeddings
    seen: set[str] = set()
    for path in weight_files(folder):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as reader:
                for name in reader.keys():
                    if tied and name == "lm_head.weight":
                        continue  # stored once, as the embedding (from_pretrained drops it too)
                    if name not in expected:
                        raise StemlmError(f"checkpoint {folder} does not match its config.json: unexpected {name}")
                    piece = reader.get_slice(name)
                    shape = tuple(piece.get_shape())
                    if shape != expected[name]:
                        raise StemlmError(
                            f"checkpoint {folder}: tensor {name} has shape {list(shape)}, config.json implies "
                            f"{list(expected[name])}"
                        )
                    seen.add(name)
                    _read_rows(name, shape, piece, reader, shards, params, tables)
        except (SafetensorError, OSError) as exc:
            raise StemlmError(f"weights file {path} is corrupt or truncated ({exc})") from None
    missing = sorted(set(expected) - seen)
    if missing:
        raise StemlmError(
            f"checkpoint {folder} does not match its config.json: missing {len(missing)} tensors (e.g. {missing[0]})"
        )


def _read_rows(name: str, shape, piece, reader, shards, params, tables) -> None:
    if not shape:
        params[name].detach().copy_(reader.get_tensor(name))
        return
    row_values = 1
    for size in shape[1:]:
        row_values *= size
    if name in shards:
        keep = _keep_strided(shards[name].detach(), tables.rank, tables.world_size)
        for start, stop in _row_blocks(shape[0], row_values):
            keep(start, stop, piece[start:stop])
        return
    local, offset = _local_and_offset(params[name].detach())
    stop = offset + (local.shape[0] if local.dim() else shape[0])
    if stop > offset:  # an FSDP2 shard past the last row (more ranks than rows) reads nothing
        _keep_block(local, offset)(offset, stop, piece[offset:stop])
