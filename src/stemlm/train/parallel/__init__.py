"""Distributed training pieces, applied to the single-device model from outside (by `stemlm.train.trainer`):
DDP / FSDP2 with checkpointing and compile in torchtitan's order (`parallelize`), vocabulary-row-sharded tables
and their row exchanges (`sharded_tables`, `row_plan`, `comm`), host-memory row shards (`host_shards`), torchrun
set-up (`launch`), sharded DCP checkpoints (`checkpoint`) and meta-device initialisation of one rank's shards
(`meta_init`). Names load lazily:

    from stemlm.train.parallel import ShardedTables, init_distributed
"""

from stemlm._lazy import lazy_exports

_EXPORTS = {
    "CommCounter": "stemlm.train.parallel.comm",
    "all_to_all_rows": "stemlm.train.parallel.comm",
    "exchange_counts": "stemlm.train.parallel.comm",
    "DistInfo": "stemlm.train.parallel.launch",
    "init_distributed": "stemlm.train.parallel.launch",
    "local_batch_size": "stemlm.train.parallel.launch",
    "torchrun_command": "stemlm.train.parallel.launch",
    "RowPlan": "stemlm.train.parallel.sharded_tables",
    "ShardedTables": "stemlm.train.parallel.sharded_tables",
    "TableRowsFromShards": "stemlm.train.parallel.sharded_tables",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
