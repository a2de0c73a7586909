"""Distributed training pieces: vocabulary-row-sharded STEM tables, row exchanges with byte accounting, and
torchrun helpers. The backbone is wrapped by DDP / FSDP2 in the trainer; the tables are handled here.
"""

from stemlm.dist.comm import CommCounter, all_to_all_rows, exchange_counts
from stemlm.dist.launch import DistInfo, init_distributed, local_batch_size, torchrun_command
from stemlm.dist.sharded_tables import RowPlan, ShardedTables, TableRowsFromShards

__all__ = [
    "CommCounter",
    "DistInfo",
    "RowPlan",
    "ShardedTables",
    "TableRowsFromShards",
    "all_to_all_rows",
    "exchange_counts",
    "init_distributed",
    "local_batch_size",
    "torchrun_command",
]
