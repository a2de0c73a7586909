"""Token tables that train from host memory (`stemlm train --tables host`): rows go to the device ahead of use.

The tables and their row-sparse optimizer state live outside the compute device: in pinned host memory when
the device is CUDA, in a separate CPU buffer otherwise (so the same code path runs, and is tested, on a CPU).
The provider is generic over one fact: the ids a forward will look up are known before it runs
(`ids_for(window)`; for STEM the input ids of a data window, for n-gram keys whatever ids the batch implies).
`HostTables` is the `host` training placement of one process (`stemlm.placement.base.Placement`):
the trainer hands it the run's micro-batches (`bind`), takes each micro-batch's rows from it (`rows`), lets it
finish their gradients (`finish_grads`) and wraps the table optimizer with it (`wrap_optimizers`).

Per optimizer step of `windows_per_step` micro-batches, on one worker thread (FIFO, so order = correctness):

1. gather: unique ids of the next window -> their rows of every table (index_select into pinned staging),
   copied to the device on a side CUDA stream; queued while the current micro-batch computes;
2. forward/backward on the device buffer: position p reads `buffer[inverse[p]]`; the backward records the
   same per-position sparse gradient `nn.Embedding(sparse=True)` would, accumulated over micro-batches the
   way autograd accumulates sparse gradients, and coalesced once on the device (`finish_grads`), so only the
   unique rows' gradient crosses to the host;
3. the table optimizer steps on the host on the worker thread (`AsyncTableOptimizer`), overlapped with the
   backbone optimizer and the next step's batch preparation; the next step's first gather is queued behind it,
   so it reads the updated rows. A checkpoint, an evaluation or `sync()` waits for the queue.

Exactness: on a CPU the rows, the per-position gradients, their accumulation and coalescing, the clip and
the optimizer are the same operations on the same values as resident tables with the same row-sparse
optimizer, so a run ends bitwise equal (tests/placement/test_host.py). Only row-sparse optimizers
(lazy_adamw, rowwise_adagrad) are supported: dense AdamW would touch every row every step.
`overlap` = 1 - (time the trainer waited for the worker) / (time the worker worked).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from torch import nn

from stemlm.choices import ROW_SPARSE_OPTIMIZERS
from stemlm.errors import StemlmError
from stemlm.offload.compact import CompactProvider
from stemlm.offload.providers import HostProvider, TableProvider
from stemlm.placement.base import Placement, Rows, StoredTables
from stemlm.placement.lookahead import LookaheadWorker


@dataclass
class Gathered:
    """One window's rows on the device: `rows[layer][inverse]` are the rows of `ids` (shape [B, T])."""

    ids: torch.Tensor  # [B, T] the ids the rows were gathered for (on the CPU when the device is CUDA)
    inverse: torch.Tensor  # [B, T] on the device: index of each position's id among the unique ids
    rows: dict[int, torch.Tensor]  # layer -> [unique ids, width] on the device
    event: object = None  # CUDA event after the copies (None on CPU)


class InHostMemory:
    """What the host placements (this one and the host-sharded one) declare alike: the `--tables host` word, the
    row-sparse optimizer they need, a construction from (model, device) and the report line of the host bytes."""

    tables = "host"
    where = "in host memory"
    row_sparse_only = True

    @classmethod
    def for_training(cls, model: nn.Module, device: torch.device):
        return cls(model, device)

    @classmethod
    def report_lines(cls, r: dict) -> list[str]:
        overlap = "n/a" if r["host_overlap"] is None else f"{r['host_overlap']:.0%}"
        return [
            f"tables in host memory: {r['device_bytes_saved'] / 2**20:,.1f} MiB kept off the {r['device']} "
            f"({r['host_table_bytes'] / 2**20:,.1f} MiB tables + {r['host_optimizer_bytes'] / 2**20:,.1f} MiB "
            f"optimizer state); host work hidden behind compute: {overlap}"
        ]


class HostTables(InHostMemory, LookaheadWorker, Placement):
    """A model's token tables in host memory with look-ahead gathers and a host-side optimizer step."""

    name = "host"
    offloaded = True

    # ----- inference: the rows in host memory, in the format asked for -----
    @classmethod
    def provider(cls, stored: StoredTables) -> TableProvider:
        """fp32 rows as the file has them (one token-major matrix, or one per layer), else compact rows
        (`stemlm.offload.compact`: bf16, or int8 with a scale per row and layer) converted on load."""
        if stored.plain and stored.want == "fp32":
            return HostProvider(stored.entries, layout=stored.layout, pin=stored.pin, dtype=stored.dtype)
        return CompactProvider(stored.sources, stored.want, out_dtype=stored.dtype or torch.float32, pin=stored.pin)

    @classmethod
    def byte_counts(cls, table_bytes: int) -> dict[str, int]:
        return {"host_table_bytes": table_bytes, "mapped_table_bytes": 0}

    # ----- training: the run's tables -----
    def __init__(self, model: nn.Module, device: torch.device) -> None:
        tables = model.token_tables()
        if not tables:
            raise StemlmError(f"--tables host needs a model with token tables (ffn={model.config.ffn} has none)")
        self.device = device
        self.ids_for: Callable[[int], torch.Tensor] | None = None  # a window's input ids on the host (`bind`)
        self.windows_per_step = 1
        self.cuda = device.type == "cuda"
        self.layers = sorted(tables)
        self.params: dict[int, nn.Parameter] = {}
        with torch.no_grad():
            for i in self.layers:
                host = tables[i].weight.detach().to("cpu", copy=True)
                host = host.pin_memory() if self.cuda else host
                tables[i].weight = self.params[i] = nn.Parameter(host)  # the model's table *is* the host buffer
                tables[i].sparse = True
        self.grads: dict[int, torch.Tensor | None] = dict.fromkeys(self.layers)
        self.window_grads: dict[int, torch.Tensor] = {}  # the current window's, summed into `grads` at its end
        self._start_worker("stemlm-host-tables")
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.pending: dict[int, Future] = {}
        self._staging = [{"rows": {}, "event": None} for _ in range(2)]
        self._turn = 0
        self.last_window = -1

    # ----- the training placement (stemlm.placement.base) -----
    def bind(self, batches, cfg, autocast) -> None:
        self.ids_for, self.windows_per_step = batches.ids, cfg.grad_accum

    def wrap_optimizers(self, optimizers: list[torch.optim.Optimizer], cfg) -> list:
        return [*optimizers[:-1], self.wrap(optimizers[-1], cfg.table_optim)]  # the recipe's table optimizer: last

    def rows(self, window: int, ids: torch.Tensor) -> Rows:
        return {"token": self.train_rows(window, ids)}

    def lookup_rows(self) -> Rows:
        return {"token": self.lookup}

    # ----- memory -----
    def table_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params.values())

    # ----- gathers -----
    def _gather(self, ids: torch.Tensor) -> Gathered:
        host_ids = ids.reshape(-1).to("cpu")
        uniq, inverse = torch.unique(host_ids, sorted=True, return_inverse=True)
        inverse = inverse.reshape(ids.shape)
        if not self.cuda:  # the autograd Function below runs its backward only for inputs that require grad
            rows = {i: self.params[i].detach().index_select(0, uniq).requires_grad_() for i in self.layers}
            return Gathered(ids, inverse, rows)
        # Two pinned staging sets used in turn: a set is refilled only after its previous copy has finished.
        slot = self._staging[self._turn % 2]
        self._turn += 1
        if slot["event"] is not None:
            slot["event"].synchronize()
        n = uniq.numel()
        for i in self.layers:
            buf = slot["rows"].get(i)
            if buf is None or buf.shape[0] < n:
                buf = slot["rows"][i] = torch.empty(
                    max(n, ids.numel()), self.params[i].shape[1], dtype=self.params[i].dtype, pin_memory=True
                )
            torch.index_select(self.params[i].detach(), 0, uniq, out=buf[:n])
        with torch.cuda.stream(self.stream):
            rows = {i: slot["rows"][i][:n].to(self.device, non_blocking=True).requires_grad_() for i in self.layers}
            inv = inverse.to(self.device)  # small; a pageable copy returns once done
            event = torch.cuda.Event()
            event.record(self.stream)
        slot["event"] = event
        return Gathered(host_ids.reshape(ids.shape), inv, rows, event)

    def prefetch(self, window: int) -> None:
        """Queue the gather of `window`'s rows (behind any queued optimizer step)."""
        if window not in self.pending:
            self.pending[window] = self._timed(self._gather, self.ids_for(window))

    def train_rows(self, window: int, ids: torch.Tensor) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """The `token` row provider of training window `window` (whose input ids are `ids`); queues the next
        window's gather when it belongs to the same optimizer step (no update lies between them)."""
        self._end_window()  # the previous window's backward is done
        self.prefetch(window)
        got = self._wait(self.pending.pop(window))
        self.last_window = window
        if ids.device.type == "cpu" and not torch.equal(got.ids, ids):  # a device comparison would sync
            raise StemlmError(f"host tables: window {window} was gathered for other ids than the trainer's batch")
        if (window + 1) % self.windows_per_step:
            self.prefetch(window + 1)
        if got.event is not None:
            torch.cuda.current_stream(self.device).wait_event(got.event)
            for t in (*got.rows.values(), got.inverse):
                t.record_stream(torch.cuda.current_stream(self.device))
        return _TrainRows(self, got)

    def lookup(self, layer_idx: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows for inference (evaluation, sampling): waits for queued updates, no gradient."""
        self.sync()
        rows = self.params[layer_idx].detach()[ids.to("cpu")]
        return rows.to(self.device, non_blocking=self.cuda)

    # ----- gradients -----
    def add_grad(self, layer_idx: int, grad: torch.Tensor) -> None:
        # Grouped as autograd groups them, so the sums round alike: the uses of one table within a window (layers
        # sharing it) meet first (autograd's input buffer), then each window's sum joins the step's (`.grad`).
        acc = self.window_grads.get(layer_idx)
        self.window_grads[layer_idx] = grad if acc is None else acc + grad

    def _end_window(self) -> None:
        for i, grad in self.window_grads.items():
            acc = self.grads[i]
            self.grads[i] = grad if acc is None else acc + grad  # sparse + sparse, as autograd accumulates
        self.window_grads = {}

    def finish_grads(self) -> None:
        """Coalesce each table's accumulated gradient on the device and hand it to the host parameter."""
        self._end_window()
        for i in self.layers:
            acc, self.grads[i] = self.grads[i], None
            if acc is None:
                continue
            acc = acc.coalesce()
            idx, values = acc.indices().to("cpu"), acc.values().to("cpu")
            self.params[i].grad = torch.sparse_coo_tensor(
                idx, values, self.params[i].shape, is_coalesced=True, check_invariants=False
            )

    def clear_grads(self) -> None:
        self.grads, self.window_grads = dict.fromkeys(self.layers), {}

    # ----- the host-side optimizer -----
    def wrap(self, optimizer: torch.optim.Optimizer, name: str) -> AsyncTableOptimizer:
        if name not in ROW_SPARSE_OPTIMIZERS:
            raise StemlmError(
                f"--tables host needs a row-sparse table optimizer ({', '.join(ROW_SPARSE_OPTIMIZERS)}), got {name!r}"
            )
        return AsyncTableOptimizer(self, optimizer)

    def summary(self, optimizers: list) -> dict[str, object]:
        """Bytes kept off the device (tables + their optimizer state) and the overlap, for the run's report."""
        self.sync()
        state = sum(
            t.numel() * t.element_size()
            for s in optimizers[-1].inner.state.values()
            for t in s.values()
            if torch.is_tensor(t)
        )
        return {
            "tables": "host",
            "device_bytes_saved": self.table_bytes() + state,
            "host_table_bytes": self.table_bytes(),
            "host_optimizer_bytes": state,
            "host_overlap": self.overlap(),
        }

    def close(self) -> None:
        self.sync()
        self.pending.clear()
        self.worker.shutdown(wait=True)


class AsyncTableOptimizer:
    """The table optimizer of host tables, stepped on the worker thread; the trainer sees an optimizer.

    `param_groups` is this wrapper's own copy (the trainer's schedule writes it while the worker may still be
    stepping): each step hands the worker the learning rates of the moment it was called.
    """

    def __init__(self, host: HostTables, inner: torch.optim.Optimizer) -> None:
        self.host, self.inner = host, inner
        self.param_groups = [dict(group) for group in inner.param_groups]
        self.stepped = False

    def step(self) -> None:
        hyper = [{k: v for k, v in group.items() if k != "params"} for group in self.param_groups]

        def run() -> None:
            for group, h in zip(self.inner.param_groups, hyper, strict=True):
                group.update(h)
            self.inner.step()
            self.inner.zero_grad(set_to_none=True)  # here, not on the trainer's thread, which may be past it

        self.host._timed(run)
        self.stepped = True
        self._prefetch_next_step()  # queued behind the update: reads the updated rows, while the backbone steps

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.host.clear_grads()
        if not self.stepped:  # a skipped step: nothing queued uses these gradients
            self.inner.zero_grad(set_to_none=True)
            self._prefetch_next_step()
        self.stepped = False

    def _prefetch_next_step(self) -> None:
        host = self.host
        first = (host.last_window // host.windows_per_step + 1) * host.windows_per_step
        for window in [w for w in host.pending if w != first]:  # a step cut short by a non-finite loss
            del host.pending[window]
        host.prefetch(first)

    def state_dict(self) -> dict:
        self.host.sync()
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.host.sync()
        self.inner.load_state_dict(state)
        for group, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            group.update({k: v for k, v in inner.items() if k != "params"})


class _TrainRows:
    """The `token` row provider of one training window."""

    def __init__(self, host: HostTables, got: Gathered) -> None:
        self.host, self.got = host, got

    def __call__(self, layer_idx: int, input_ids: torch.Tensor) -> torch.Tensor:
        buffer = self.got.rows[layer_idx]
        return _RowsFromBuffer.apply(buffer, self.got.inverse, input_ids, self.host, layer_idx)


class _RowsFromBuffer(torch.autograd.Function):
    """buffer[inverse] forward; backward records the table's per-position sparse gradient with the host."""

    @staticmethod
    def forward(ctx, buffer, inverse, input_ids, host, layer_idx):
        ctx.input_ids, ctx.host, ctx.layer_idx = input_ids, host, layer_idx
        ctx.shape = host.params[layer_idx].shape
        return buffer[inverse]

    @staticmethod
    def backward(ctx, grad):
        width = ctx.shape[1]
        # What nn.Embedding(sparse=True) returns: one (id, row gradient) entry per position, uncoalesced.
        sparse = torch.sparse_coo_tensor(
            ctx.input_ids.reshape(1, -1), grad.reshape(-1, width), ctx.shape, check_invariants=False
        )
        ctx.host.add_grad(ctx.layer_idx, sparse)
        return None, None, None, None, None
