"""The training table placements by `--tables` value and world: `make_placement(cfg, model, world)` is the one
place that names them (the trainer reads only the `TablePlacement` protocol, stemlm.train.tables.placement).

To add a placement: its module (docs/architecture.md, "Add a table placement or provider"), then one branch here
that returns it for its `--tables` value and world.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from stemlm.train.config import TrainConfig
from stemlm.train.tables.placement import TablePlacement


def make_placement(cfg: TrainConfig, model: nn.Module, world: Any) -> TablePlacement:
    """The placement `cfg.tables` asks for in `world`, applied to `model` (a model on the meta device too)."""
    if world.distributed and model.token_tables():
        if cfg.tables == "host":
            from stemlm.train.parallel.host_shards import HostShardedTables

            return HostShardedTables(model, world.device)
        from stemlm.train.parallel.sharded_tables import ShardedTables

        return ShardedTables(model)
    if cfg.tables == "host" and not world.distributed:
        from stemlm.train.tables.host import HostTables

        return HostTables(model, world.device)
    from stemlm.train.tables.resident import ResidentTables

    return ResidentTables()
