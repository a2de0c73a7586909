"""Where a training run's token tables live and how a micro-batch's rows reach the model: `TablePlacement`, the
protocol the one `Trainer` calls (`stemlm.train.tables.registry.make_placement` picks one).

    tables = make_placement(cfg, model, world)        # before the backbone is wrapped (DDP / FSDP2)
    tables.bind(batches, cfg, trainer.autocast)       # once the run's micro-batches are known
    optimizers = tables.wrap_optimizers(recipe.build_optimizers(model, cfg), cfg)
    tables.begin_step(first_window, final=...)        # per step, then per micro-batch:
    out = model(x, labels=y, rows=tables.rows(window, x))
    tables.finish_grads()                             # after the step's backwards, before the clip

The placements, one module each (the docs' recipe, docs/architecture.md "A table placement", says how to add one):
- `resident` (stemlm.train.tables.resident): the tables stay in the model as ordinary parameters;
- `host` (stemlm.train.tables.host): the tables and their optimizer in host memory, rows gathered ahead;
- `row-sharded` (stemlm.train.parallel.sharded_tables): each rank owns every N-th row, rows exchanged per
  micro-batch;
- `host-sharded` (stemlm.train.parallel.host_shards): row shards in host memory.
A placement owns its state: its rows, their gradients until `finish_grads`, its optimizer wrapping, what a
checkpoint needs of it (`row_shards`, `before_save`) and its report (`summary`, `step_record`).
Tests: tests/train/tables/test_placement.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from stemlm.train.config import TrainConfig

Rows = Mapping[str, Callable]  # StemLM.forward's `rows=`: table family -> row provider


class TablePlacement:
    """The protocol (every method has the resident behaviour: nothing to do); subclasses override what differs."""

    name = "resident"
    every_rank_ids = False  # each rank reads every rank's ids of a micro-batch (its row exchange is planned on them)

    @property
    def row_shards(self):
        """The `ShardedTables` whose rows checkpoints and meta-device initialisation split over ranks, or None."""
        return None

    def bind(self, batches: Any, cfg: TrainConfig, autocast: Callable) -> None:
        """Know the run's micro-batches (`stemlm.train.batches.MicroBatches`) before the first step."""

    def wrap_optimizers(self, optimizers: list[torch.optim.Optimizer], cfg: TrainConfig) -> list:
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
        """Fields this placement adds to the run's final report."""
        return {}

    def close(self) -> None:
        """Stop any worker thread (the run is over)."""
