"""One table placement: where a model's lookup tables live and how their rows reach a forward, in training and
in inference. `Placement` is the base class; each placement is one subclass in one module of this package
(resident, host, mmap, row-sharded, host-sharded), and `stemlm.placement.registry` picks one from the `--tables`
value, the world and the purpose. Nothing outside this package compares placement names: code asks a placement
what it is (`offloaded`, `compiles`, `row_sparse_only`, `where`, `byte_counts`, `report_lines`).

A placement's class attributes declare it; its classmethods serve inference; an instance is one training run's
tables:

    placement = choose("host", "inference")           # a class
    provider = placement.provider(stored)             # the rows of a checkpoint's tables (stemlm.offload)

    tables = make_placement(cfg, model, world)         # an instance, before the backbone is wrapped (DDP / FSDP2)
    tables.bind(batches, cfg, trainer.autocast)        # once the run's micro-batches are known
    optimizers = tables.wrap_optimizers(recipe.build_optimizers(model, cfg), cfg)
    tables.begin_step(first_window, final=...)         # per step, then per micro-batch:
    out = model(x, labels=y, rows=tables.rows(window, x))
    tables.finish_grads()                              # after the step's backwards, before the clip

In inference an offloaded placement's provider answers `gather(ids)` (`stemlm.offload.providers.TableProvider`);
the hot-row cache, the prefetch pipeline and the decoding engine's row source work on any provider, so a
placement supplies only the row store and says what it costs (`byte_counts`) and where the rows are (`where`).
In training an instance owns its state: its rows, their gradients until `finish_grads`, its optimizer wrapping,
what a checkpoint needs of it (`row_shards`, `before_save`) and its report (`summary`, `step_record`,
`report_lines`). Every method defaults to the resident behaviour (the tables are the model's own parameters),
so a placement overrides only what differs. Tests: tests/placement/.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from stemlm.errors import StemlmError
from stemlm.offload.compact import RowSource
from stemlm.offload.providers import TableProvider, TensorEntry

Rows = Mapping[str, Callable]  # StemLM.forward's `rows=`: table family -> row provider
TRAIN, INFERENCE = "train", "inference"  # the purposes a placement serves


@dataclass(frozen=True)
class StoredTables:
    """One provider's worth of a checkpoint's tables, as an offloaded placement builds its row store from them."""

    directory: Path
    entries: dict[int, TensorEntry]  # layer -> the table's safetensors entry (checked against config.json)
    stored: str  # the row format the checkpoint holds: fp32, bf16 or int8
    want: str  # the row format asked for (`--table-dtype`; as stored when not given)
    plain: bool  # fp32 rows without a storage record: the ordinary safetensors tensors
    layout: str  # "token" (one token-major matrix) or "layer" (one matrix per layer), where the store has a choice
    pin: bool  # pin the staging buffer of each gather (a CUDA device reads it)
    dtype: torch.dtype | None  # the rows' dtype as the model reads them (None: as stored)
    make_sources: Callable[[], dict[int, RowSource]] = field(repr=False)

    @functools.cached_property
    def sources(self) -> dict[int, RowSource]:
        """The layers as row sources (int8 codes come with their scales), opened only when a placement asks."""
        return self.make_sources()


class Placement:
    """A table placement: the declaration (class attributes), inference (classmethods) and one training run's
    tables (an instance; every hook has the resident behaviour: nothing to do)."""

    name: ClassVar[str] = "resident"  # unique: the registry's key and the word reports use
    tables: ClassVar[str] = "device"  # the `--tables` value it answers to
    aliases: ClassVar[tuple[str, ...]] = ()  # other words for that value ("resident" for device)
    purposes: ClassVar[frozenset[str]] = frozenset({TRAIN, INFERENCE})
    distributed: ClassVar[bool] = False  # the training world it serves: one process (False) or several ranks (True)
    where: ClassVar[str] = "on the device"  # the tables' place in a report line
    offloaded: ClassVar[bool] = False  # inference: the tables leave the model; rows come through a provider + cache
    compiles: ClassVar[bool] = False  # inference: decoding steps may go through torch.compile (the model's own rows)
    row_sparse_only: ClassVar[bool] = False  # training: only a row-sparse table optimizer can step these tables
    every_rank_ids: ClassVar[bool] = False  # training: each rank reads every rank's ids of a micro-batch

    # ----- inference -----
    @classmethod
    def check_row_format(cls, stored: str, want: str) -> None:
        """Refuse a `--table-dtype` this placement cannot serve from a checkpoint storing `stored` rows (checked
        before anything is read)."""

    @classmethod
    def provider(cls, stored: StoredTables) -> TableProvider:
        """The row store of one family's tables of a checkpoint (offloaded placements)."""
        raise StemlmError(f"--tables {cls.tables} keeps the tables in the model; it has no row provider")

    @classmethod
    def byte_counts(cls, table_bytes: int) -> dict[str, int]:
        """The tables' bytes by where they are, for `OffloadedLM.memory()` (host memory, the mapped file)."""
        return {"host_table_bytes": 0, "mapped_table_bytes": 0}

    # ----- training: the run's tables -----
    @classmethod
    def for_training(cls, model: torch.nn.Module, device: torch.device) -> Placement:
        """This placement applied to `model` (a model on the meta device too) for a run on `device`."""
        return cls()

    @classmethod
    def report_lines(cls, record: dict[str, Any]) -> list[str]:
        """Lines of a training run's report (`record`: the final report, with this placement's `summary`)."""
        return []

    @property
    def row_shards(self):
        """The `ShardedTables` whose rows checkpoints and meta-device initialisation split over ranks, or None."""
        return None

    def bind(self, batches: Any, cfg: Any, autocast: Callable) -> None:
        """Know the run's micro-batches (`stemlm.train.batches.MicroBatches`) and config (a `TrainConfig`)."""

    def wrap_optimizers(self, optimizers: list[torch.optim.Optimizer], cfg: Any) -> list:
        """The run's optimizers with this placement's table optimizer in them (wrapped or added last)."""
        return optimizers

    def begin_step(self, first_window: int, final: bool) -> None:
        """A step of micro-batches `first_window ..` starts (`final`: no step follows it in this run)."""

    def rows(self, window: int, ids: torch.Tensor) -> Rows | None:
        """`rows=` of micro-batch `window`'s forward (its input ids `ids`); None: the model's own tables."""
        return None

    def finish_grads(self) -> None:
        """Every backward of the step has run: hand the tables' gradients to the table optimizer."""

    def lookup_rows(self) -> Rows | None:
        """`rows=` of a no-grad forward in this process alone (sampling from the trained model)."""
        return None

    def eval_rows(self, ids: torch.Tensor, all_ids: list[torch.Tensor]) -> Rows | None:
        """`rows=` of a no-grad forward of `ids` on every rank (`all_ids`: every rank's ids, on the host)."""
        return self.lookup_rows()

    def step_record(self, step: int, final: bool) -> dict[str, Any]:
        """Fields this placement adds to a step's metrics record (`final`: the run's last step)."""
        return {}

    def before_save(self) -> None:
        """A checkpoint is about to read the tables: any queued update must land first."""

    def end_training(self, failed: bool) -> None:
        """`fit` ends (`failed`: by an exception; work in flight with the other ranks is abandoned)."""

    def summary(self, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
        """Fields this placement adds to the run's final report (which has `placement`: its name)."""
        return {}

    def close(self) -> None:
        """Stop any worker thread (the run is over)."""
