"""Vocabulary-row-sharded STEM tables for data-parallel training with torch.distributed.

Each of N ranks owns the rows `r` with `r % N == rank` of every token table (strided, so the frequent low
ids of a BPE vocabulary spread evenly over the ranks) and the optimizer state of those rows; row `r` is
local row `r // N` of its owner. One step, per micro-batch:

1. `lookup(input_ids, all_ids)`: deduplicate the local batch's ids; owners answer with the rows of every
   table at once (one all_to_all of [unique ids, sum of widths]). Who asks whom for which rows is planned
   on the host from every rank's input ids (`all_ids`, on the CPU: `plan_on_host`, stemlm.placement.row_plan), so
   the rows are the only collective and nothing is read back from the device; without `all_ids`, `plan`
   agrees on it with collectives (counts, then int32 local row indices, and a read of the counts). The
   returned callable is the model's `token` row provider, so the model math is untouched:
   `model(input_ids, labels=..., rows={"token": tables.lookup(input_ids, all_ids)})`. As the trainer's `row-sharded`
   placement (`stemlm.placement.base`) it splits this into `start_window(k)` (plan and issue the exchange
   async) and `.rows()` (wait at use), so micro-batch k+1's rows travel while k computes (the shards do not change
   within a step), and a step's first micro-batch's from the previous step's table update on (a post-step hook
   of the table optimizer it adds, `wrap_optimizers`). Traffic is counted when an exchange is used, so one issued
   ahead counts in the step that uses it; `step_record` sums it over the ranks every `traffic_every` steps.
   Under autocast the rows travel and are returned in the autocast dtype (bf16: half the bytes, and the FFN
   product stays bf16), their gradients travel back in it too; the owners' shards and updates stay fp32.
2. backward: the model's gradient for each unique row (already summed over its positions) goes back to
   its owner in one all_to_all; the owner's shard receives it as a sparse COO gradient, in which rows asked
   for by several ranks appear once per rank and are summed by `coalesce` (the optimizers do that).
   With `reduce="mean"` the incoming gradients are divided by N, matching a DDP average of the backbone
   when each rank's loss is the mean over its equal share of the global batch.

Traffic per step therefore grows with the number of unique ids, not with B*S*d_ff; `self.comm` counts it.
Any of `stemlm.placement.table_optim`'s optimizers steps the shards (`tables.parameters()`): `adamw` then
updates every row of the shard, exactly as dense AdamW on the full table. Gloo (CPU) and NCCL (GPU) run
the same code. On construction the model's own tables are released (see `release_model_tables`) so DDP /
FSDP and the backbone optimizer never see them. Tests: `python -m pytest tests/dist -q -m dist`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from stemlm.errors import StemlmError
from stemlm.model.decoder import check_token_ids
from stemlm.placement.base import TRAIN, Placement, Rows
from stemlm.placement.comm import (
    CommCounter,
    all_to_all_rows,
    all_to_all_rows_async,
    exchange_counts,
    group_rank_size,
    traffic_bytes,
)
from stemlm.placement.row_plan import plan_arrays
from stemlm.placement.table_optim import flatten_optimizer_state, make_table_optimizer, unflatten_optimizer_state

TRAFFIC_KINDS = ("rows", "grads")  # the routing is planned on the host: no count or id messages


@dataclass
class RowPlan:
    """Routing of one lookup: who asks whom for which rows."""

    shape: tuple[int, ...]  # [B, T] of the input ids
    positions: torch.Tensor  # [B, T] index of each position's row among the rows received
    send_counts: list[int]  # unique ids this rank requests from each owner
    recv_counts: list[int]  # ids each rank requests from this rank
    local_rows: torch.Tensor  # [sum(recv_counts)] shard rows this rank serves, grouped by requester


class ShardedTables(nn.Module, Placement):
    """The row shards of a model's token tables on this rank, with the lookup / gradient exchange."""

    name = "row-sharded"
    tables = "device"
    purposes = frozenset({TRAIN})  # inference loads one folder written from the shards (stemlm export)
    distributed = True
    where = "row-sharded over the ranks"
    every_rank_ids = True

    @classmethod
    def for_training(cls, model: nn.Module, device: torch.device) -> ShardedTables:
        return cls(model)

    def __init__(self, model: nn.Module, group=None, reduce: str = "mean", release_model_tables: bool = True) -> None:
        super().__init__()
        if reduce not in ("mean", "sum"):
            raise StemlmError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
        tables = model.token_tables()
        if not tables:
            raise StemlmError(f"the model has no token tables to shard (ffn={model.config.ffn} has no `token` table)")
        self.group, self.reduce = group, reduce
        self.rank, self.world_size = group_rank_size(group)
        self.vocab_size = model.config.vocab_size
        self.layers = sorted(tables)
        names = {id(module): name for name, module in model.named_modules()}
        self.model_names = {i: f"{names[id(tables[i])]}.weight" for i in self.layers}
        # Every rank holds the same initialised model (same seed), so each just keeps its own rows.
        self.shards = nn.ParameterDict(
            {str(i): nn.Parameter(self.local_rows_of(tables[i].weight.detach()).clone()) for i in self.layers}
        )
        self.comm = CommCounter()
        self._hooks: dict[int, object] = {}
        self.meta_shards = any(p.is_meta for p in self.shards.values())  # allocated later (meta_init.materialise)
        self._ahead: tuple[int, PendingRows] | None = None  # the next step's first exchange, issued early
        if release_model_tables:
            for i in self.layers:
                self._release(i, tables[i])

    # ----- layout -----
    def num_local_rows(self, rank: int | None = None) -> int:
        rank = self.rank if rank is None else rank
        return max(0, (self.vocab_size - rank + self.world_size - 1) // self.world_size)

    def global_ids(self, rank: int | None = None) -> torch.Tensor:
        """Global row ids held by `rank`, in local order."""
        return torch.arange(self.rank if rank is None else rank, self.vocab_size, self.world_size)

    def local_rows_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full [V, ...] tensor (a view)."""
        return full[self.rank :: self.world_size]

    def shard(self, layer_idx: int) -> nn.Parameter:
        return self.shards[str(layer_idx)]

    # ----- lookup -----
    def plan(self, input_ids: torch.Tensor) -> RowPlan:
        """Deduplicate the ids and agree with the other ranks on who sends which rows (collective)."""
        check_token_ids(input_ids, self.vocab_size)
        n = self.world_size
        uniq, inverse = torch.unique(input_ids.reshape(-1), sorted=True, return_inverse=True)
        owner = uniq % n
        order = torch.argsort(owner, stable=True)
        send_counts_t = torch.bincount(owner, minlength=n)
        recv_counts_t = exchange_counts(send_counts_t, self.group, self.comm)
        send_counts, recv_counts = torch.stack([send_counts_t, recv_counts_t]).tolist()  # the one host sync
        request = (uniq[order] // n).to(torch.int32)  # local row index at the owner; V < 2**31
        local_rows = all_to_all_rows(request, send_counts, recv_counts, self.group, self.comm, "ids").long()
        slot = torch.empty_like(order)
        slot[order] = torch.arange(order.numel(), device=order.device)  # unique id -> its received row
        return RowPlan(
            tuple(input_ids.shape), slot[inverse].reshape(input_ids.shape), send_counts, recv_counts, local_rows
        )

    def plan_on_host(self, all_ids: Sequence[torch.Tensor], device: torch.device | None = None) -> RowPlan:
        """The same routing as `plan`, computed alone from every rank's input ids on the CPU (no collective,
        no device read; see stemlm.placement.row_plan). `all_ids[rank]` are this rank's ids; positions go to
        `device` (default: the shards' device), the rows to serve stay on the shards' device."""
        positions, send_counts, recv_counts, local_rows = plan_arrays(
            all_ids, self.rank, self.world_size, self.vocab_size
        )
        device = self._shard_device() if device is None else device
        return RowPlan(
            tuple(all_ids[self.rank].shape),
            torch.from_numpy(positions).to(device, non_blocking=True),
            send_counts,
            recv_counts,
            torch.from_numpy(local_rows).to(self._shard_device(), non_blocking=True),
        )

    def start_lookup(self, plan: RowPlan, dtype: torch.dtype | None = None) -> PendingRows:
        """Issue the plan's row exchange without waiting for it (collective, async); `.rows()` of the result is
        the `token` row provider. `dtype`: the dtype the rows travel in (default: the autocast dtype if autocast
        is on here, else the shards'). The shards must not change until `.rows()` (true within one step)."""
        return self._exchange(plan, self._serve(plan), dtype)

    def lookup(self, input_ids: torch.Tensor, all_ids: Sequence[torch.Tensor] | None = None) -> TableRowsFromShards:
        """Fetch this micro-batch's rows of every table (collective); pass the result as `rows={"token": ...}`.

        With `all_ids` (every rank's input ids on the CPU, this rank's equal to `input_ids`) the routing is
        planned on the host (one collective: the rows; the backward adds the gradients'); without, by `plan`.
        """
        if all_ids is None:
            plan = self.plan(input_ids)
        else:
            if tuple(all_ids[self.rank].shape) != tuple(input_ids.shape):
                raise StemlmError(
                    f"all_ids[{self.rank}] has shape {list(all_ids[self.rank].shape)} but input_ids "
                    f"{list(input_ids.shape)}: pass this rank's input ids at index rank"
                )
            plan = self.plan_on_host(all_ids, input_ids.device)
        return self.start_lookup(plan).rows()

    # ----- look-ahead over training windows (the trainer's micro-batches) -----
    def bind_windows(
        self, ids_for: Callable[[int], Sequence[torch.Tensor]], windows_per_step: int, device: torch.device
    ) -> None:
        """`ids_for(window)`: every rank's input ids (CPU) of training micro-batch `window`."""
        self.ids_for, self.windows_per_step, self.compute_device = ids_for, windows_per_step, device

    def prefetch(self, window: int) -> None:
        """Prepare `window`'s rows ahead (device shards: nothing to prepare; the plan is cheap host work)."""

    def start_window(self, window: int, dtype: torch.dtype | None = None) -> PendingRows:
        """Plan `window` on the host and issue its row exchange (async); see `start_lookup`."""
        return self.start_lookup(self.plan_on_host(self.ids_for(window), self.compute_device), dtype)

    def _shard_device(self) -> torch.device:
        return self.shard(self.layers[0]).device

    def _serve(self, plan: RowPlan) -> torch.Tensor:
        """[sum(recv_counts), sum of widths]: the rows this rank serves, on the exchange device."""
        local_rows = plan.local_rows.to(self._shard_device())
        return torch.cat([self.shard(i).detach().index_select(0, local_rows) for i in self.layers], dim=1)

    def _exchange(self, plan: RowPlan, served: torch.Tensor, dtype: torch.dtype | None) -> PendingRows:
        device_type = served.device.type
        if dtype is None and torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
        if dtype is not None:
            # Under autocast the rows cross ranks and enter the FFN product in the autocast dtype (half the
            # bytes); the owners keep their fp32 master rows and receive the gradients back as fp32.
            served = served.to(dtype)
        got, work = all_to_all_rows_async(served, plan.recv_counts, plan.send_counts, self.group)
        pending = PendingRows(self, plan, got, work, served)
        if self.world_size > 1:  # counted when used, so an exchange issued ahead counts in the step that uses it
            pending.traffic = traffic_bytes(served, plan.recv_counts, plan.send_counts, self.rank)
        return pending

    def _to_master(self, grads: torch.Tensor, dtype: torch.dtype, plan: RowPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """(gradient rows received by this owner, in the shards' dtype and place; their local row indices)."""
        device = self._shard_device()
        return grads.to(device, dtype), plan.local_rows.to(device)

    # ----- the training placement (stemlm.placement.base) -----
    @property
    def row_shards(self) -> ShardedTables:
        return self

    def bind(self, batches, cfg, autocast) -> None:
        self.bind_windows(batches.rank_ids, cfg.grad_accum, batches.world.device)
        self.autocast, self.traffic_every = autocast, cfg.traffic_every
        self.traffic, self.traffic_steps = dict.fromkeys(TRAFFIC_KINDS, 0), 0  # this rank's, since the last record
        self._first, self._final, self._pending = 0, True, None
        # FSDP2 runs built on the meta device have never coalesced per micro-batch (the hooks went to the meta
        # shards that materialisation replaces): kept so that they stay bitwise reproducible.
        if not (cfg.parallel == "fsdp" and self.meta_shards):
            for shard in self.parameters():
                shard.register_post_accumulate_grad_hook(_coalesce_grad)

    def _table_optimizer(self, cfg) -> torch.optim.Optimizer:
        table_opt = make_table_optimizer(
            cfg.table_optim,
            self.parameters(),
            lr=cfg.table_peak_lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            weight_decay=cfg.table_wd,
        )
        for group in table_opt.param_groups:
            group.update(name="tables", peak_lr=cfg.table_peak_lr)
        return table_opt

    def wrap_optimizers(self, optimizers: list[torch.optim.Optimizer], cfg) -> list:
        """The backbone's optimizers (the tables left the model's parameters) and the shards' own, whose update
        issues the next step's first exchange (its rows then travel while the backbone steps)."""
        table_opt = self._table_optimizer(cfg)
        self._ahead_hook = table_opt.register_step_post_hook(self._exchange_next_step)
        return [*optimizers, table_opt]

    def begin_step(self, first_window: int, final: bool) -> None:
        # The exchange is planned on the host (no collective, no device read) and issued one micro-batch ahead:
        # window k+1's rows travel while k computes, and the first window's since the previous step's table
        # update. Host shards also gather two windows ahead.
        self.comm.pop_step()  # drop the held-out evaluation's lookups: count this step's traffic only
        self._first, self._final = first_window, final
        for window in range(first_window, first_window + min(2, self.windows_per_step)):
            self.prefetch(window)
        if self._ahead is not None and self._ahead[0] == first_window:
            self._pending, self._ahead = self._ahead[1], None
        else:
            self._drop_ahead()
            with self.autocast():
                self._pending = self.start_window(first_window)

    def rows(self, window: int, ids: torch.Tensor) -> Rows:
        """The rows of `window` (exchanged while the previous micro-batch computed); issues the next exchange."""
        k = window - self._first
        rows = {"token": self._pending.rows()}
        if k + 2 < self.windows_per_step:
            self.prefetch(window + 2)
        if k + 1 < self.windows_per_step:
            self._pending = self.start_window(window + 1)
        return rows

    def eval_rows(self, ids: torch.Tensor, all_ids: list[torch.Tensor]) -> Rows:
        return {"token": self.lookup(ids, all_ids=all_ids)}  # every rank's ids are here: planned on the host

    def _exchange_next_step(self, *_) -> None:
        """Issue the next step's first exchange as soon as the table update has run. Not after the last step,
        nor after a skipped one (the hook runs on an update only)."""
        if not self._final:
            first = self._first + self.windows_per_step
            with self.autocast():
                self._ahead = (first, self.start_window(first))

    def _drop_ahead(self) -> None:
        """Wait out an exchange issued for a step that will not run here (the run stopped or ended)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead[1].wait()

    def step_record(self, step: int, final: bool) -> dict[str, int]:
        sent = self.comm.pop_step()  # host-side byte counts: no device read, no collective
        for kind in TRAFFIC_KINDS:
            self.traffic[kind] += sent.get(f"table_bytes_sent/{kind}", 0)
        self.traffic_steps += 1
        if step % self.traffic_every and not final:  # the same on every rank
            return {}
        # Bytes sent between ranks since the last record, summed over the ranks (collective).
        counts = torch.tensor([self.traffic[kind] for kind in TRAFFIC_KINDS], dtype=torch.int64)
        counts = counts.to(self.compute_device)
        torch.distributed.all_reduce(counts)
        values = counts.tolist()
        record = {"table_bytes_sent": sum(values), "table_traffic_steps": self.traffic_steps}
        self.traffic, self.traffic_steps = dict.fromkeys(TRAFFIC_KINDS, 0), 0
        return record | {f"table_bytes_sent/{kind}": v for kind, v in zip(TRAFFIC_KINDS, values, strict=True)}

    def end_training(self, failed: bool) -> None:
        if failed:
            self._ahead = None  # not waited: a failed peer would never complete it
        else:
            self._drop_ahead()  # a stop ends the run after a step that already issued the next one's exchange

    # ----- gathering and loading (for checkpoints and evaluation) -----
    def gather_rows(self, local: torch.Tensor) -> torch.Tensor:
        """Reassemble a row-sharded tensor ([local rows, ...] on every rank) into [V, ...] on every rank."""
        if self.world_size == 1:
            return local.clone()
        padded_rows = self.num_local_rows(0)
        padded = local.new_zeros((padded_rows, *local.shape[1:]))
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, padded, group=self.group)
        # full[j * N + k] = shard_k[j]
        full = torch.stack(parts, dim=1).reshape(padded_rows * self.world_size, *local.shape[1:])
        return full[: self.vocab_size].clone()

    def full_tables(self) -> dict[int, torch.Tensor]:
        """Layer index -> the full table, on every rank (collective)."""
        return {i: self.gather_rows(self.shard(i).detach()) for i in self.layers}

    @torch.no_grad()
    def load_full_tables(self, tables: dict[int, torch.Tensor]) -> None:
        """Keep this rank's rows of full tables (e.g. read from a checkpoint written with any world size)."""
        for i in self.layers:
            self.shard(i).copy_(self.local_rows_of(tables[i]))

    def unshard_into(self, model: nn.Module) -> None:
        """Put the full tables back into the model as parameters (collective), e.g. to save_pretrained."""
        full = self.full_tables()
        for i, table in model.token_tables().items():
            if i in self._hooks:
                self._hooks.pop(i).remove()
                del table.weight
            table.weight = nn.Parameter(full[i].to(self.shard(i).device))

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
        """The shards' optimizer state with row-sharded tensors gathered to [V, ...] (collective)."""
        tensors, meta = flatten_optimizer_state(optimizer.state_dict())
        rows = self._rows_per_state_index(optimizer)
        return {k: self.gather_rows(v) if _is_row_state(k, v, rows) else v for k, v in tensors.items()}, meta

    def load_full_optimizer_state(
        self, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict
    ) -> None:
        """Load `full_optimizer_state` output (from any world size) into this rank's optimizer."""
        full_rows = {i: self.vocab_size for i in self._rows_per_state_index(optimizer)}
        local = {k: self.local_rows_of(v).clone() if _is_row_state(k, v, full_rows) else v for k, v in tensors.items()}
        optimizer.load_state_dict(unflatten_optimizer_state(local, meta))

    def local_state(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, torch.Tensor]:
        """This rank's shards (and optimizer tensors) under rank-unique keys, for torch.distributed.checkpoint.

        Keys carry `shard<rank>of<N>` so DCP saves every rank's piece instead of deduplicating same-named
        tensors as replicas; loading it therefore needs the same N (use the full_* methods to change N).
        """
        tag = f"shard{self.rank}of{self.world_size}"
        state = {f"token_tables.{tag}.layer{i}": self.shard(i).detach() for i in self.layers}
        if optimizer is not None:
            tensors, _ = flatten_optimizer_state(optimizer.state_dict())
            state.update({f"table_optim.{tag}.{k}": v for k, v in tensors.items()})
        return state

    def load_local_state(
        self,
        state: dict[str, torch.Tensor],
        optimizer: torch.optim.Optimizer | None = None,
        optimizer_meta: dict | None = None,
    ) -> None:
        tag = f"shard{self.rank}of{self.world_size}"
        with torch.no_grad():
            for i in self.layers:
                self.shard(i).copy_(state[f"token_tables.{tag}.layer{i}"])
        if optimizer is not None:
            prefix = f"table_optim.{tag}."
            tensors = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            meta = optimizer_meta if optimizer_meta is not None else flatten_optimizer_state(optimizer.state_dict())[1]
            optimizer.load_state_dict(unflatten_optimizer_state(tensors, meta))

    # ----- internals -----
    def _release(self, layer_idx: int, table: nn.Embedding) -> None:
        # An empty, non-persistent buffer: not a parameter (DDP, FSDP and the backbone optimizer skip it), not
        # in state_dict, and a pre-hook explains what to do if the table is read without a `token` row provider.
        width = table.weight.shape[1]
        device, dtype = table.weight.device, table.weight.dtype
        del table.weight
        table.register_buffer("weight", torch.empty(0, width, device=device, dtype=dtype), persistent=False)
        self._hooks[layer_idx] = table.register_forward_pre_hook(_sharded_table_called)

    def _rows_per_state_index(self, optimizer: torch.optim.Optimizer) -> dict[int, int]:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return {i: p.shape[0] for i, p in enumerate(params)}


def _coalesce_grad(param: torch.Tensor) -> None:
    # Autograd adds sparse gradients by concatenation: over grad_accum micro-batches a shard's gradient would
    # hold every micro-batch's rows (duplicates included) until the optimizer coalesces. Coalescing after each
    # accumulation keeps it at most one entry per shard row.
    if param.grad is not None and param.grad.is_sparse:
        param.grad = param.grad.coalesce()


def _is_row_state(key: str, value: torch.Tensor, rows: dict[int, int]) -> bool:
    # Row-sharded state has one entry per table row (moments, per-row steps, row accumulators); a scalar step
    # count (dense AdamW) is replicated.
    index = int(key.split(".")[1])
    return value.dim() >= 1 and value.shape[0] == rows[index]


def _sharded_table_called(module: nn.Module, args) -> None:
    raise StemlmError(
        "this token table is sharded across ranks; call the model with rows={'token': sharded_tables.lookup(input_ids)}"
    )


class TableRowsFromShards:
    """The `token` row provider `(layer_idx, input_ids) -> rows` serving one micro-batch's fetched rows."""

    def __init__(self, rows: dict[int, torch.Tensor], plan: RowPlan) -> None:
        self.rows, self.plan = rows, plan

    def __call__(self, layer_idx: int, input_ids: torch.Tensor) -> torch.Tensor:
        if tuple(input_ids.shape) != self.plan.shape:
            raise StemlmError(
                f"table rows were fetched for input ids of shape {list(self.plan.shape)} but the model asked for "
                f"{list(input_ids.shape)}: call lookup() with the exact input_ids given to the model"
            )
        return self.rows[layer_idx][self.plan.positions]


class PendingRows:
    """One micro-batch's row exchange, issued and possibly still in flight; `rows()` waits and returns the hook."""

    def __init__(self, tables: ShardedTables, plan: RowPlan, got: torch.Tensor, work, served: torch.Tensor) -> None:
        self.tables, self.plan, self.got, self.work = tables, plan, got, work
        self.served = served  # the send buffer must outlive the exchange
        self.traffic: tuple[int, int] | None = None

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work, self.served = None, None
        if self.traffic is not None:
            self.tables.comm.record("rows", *self.traffic)
            self.traffic = None
        return self.got

    def rows(self) -> TableRowsFromShards:
        """Wait for the exchange; the rows, connected to the shards for the backward's gradient exchange."""
        tables = self.tables
        rows = _ExchangedRows.apply(tables, self, *(tables.shard(i) for i in tables.layers))
        return TableRowsFromShards(dict(zip(tables.layers, rows, strict=True)), self.plan)


class _ExchangedRows(torch.autograd.Function):
    """The exchanged rows of every shard (forward: wait for them); backward sends their gradients to the owners."""

    @staticmethod
    def forward(ctx, tables: ShardedTables, pending: PendingRows, *shards: torch.Tensor):
        ctx.tables, ctx.plan = tables, pending.plan
        ctx.shapes = [s.shape for s in shards]
        ctx.widths = [s.shape[1] for s in shards]
        ctx.master_dtype = shards[0].dtype
        got = pending.wait()
        if len(shards) == 1:
            return (got,)
        return tuple(part.contiguous() for part in got.split(ctx.widths, dim=1))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        tables, plan = ctx.tables, ctx.plan
        grad = torch.cat(grads, dim=1)
        if tables.reduce == "mean" and tables.world_size > 1:
            grad = grad / tables.world_size
        back = all_to_all_rows(grad, plan.send_counts, plan.recv_counts, tables.group, tables.comm, "grads")
        back, local_rows = tables._to_master(back, ctx.master_dtype, plan)
        indices = local_rows[None]
        shard_grads = [
            torch.sparse_coo_tensor(indices, part.contiguous(), shape, check_invariants=False)
            for part, shape in zip(back.split(ctx.widths, dim=1), ctx.shapes, strict=True)
        ]
        return (None, None, *shard_grads)
