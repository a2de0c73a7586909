"""Distributed training pieces, applied to the single-device model from outside (by `stemlm.train.trainer`):
DDP / FSDP2 with checkpointing and compile in torchtitan's order (`parallelize`), torchrun set-up (`launch`),
sharded DCP checkpoints (`checkpoint`) and meta-device initialisation of one rank's shards (`meta_init`). The
row-sharded table placements and their row exchanges are table placements (`stemlm.placement.row_sharded`,
`host_sharded`, `comm`, `row_plan`). Names load lazily:

    from stemlm.train.parallel import init_distributed
"""

from stemlm._lazy import lazy_exports

_EXPORTS = {
    "DistInfo": "stemlm.train.parallel.launch",
    "init_distributed": "stemlm.train.parallel.launch",
    "local_batch_size": "stemlm.train.parallel.launch",
    "torchrun_command": "stemlm.train.parallel.launch",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
