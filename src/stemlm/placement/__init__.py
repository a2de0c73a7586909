"""Table placements: where a model's lookup tables live and how their rows reach a forward, in training and in
inference, one class per placement (`base.Placement`) and one registry (`registry`) that picks one from the
`--tables` value, the purpose and the world:

- `resident` (`--tables device`, or `resident`): the tables are the model's own parameters;
- `host` (`--tables host`): the tables in host memory, rows gathered ahead to the device (training: with a
  host-side row-sparse optimizer step; inference: through the device's hot-row cache);
- `mmap` (`--tables mmap`, inference only): the rows read on demand from the memory-mapped checkpoint;
- `row-sharded` / `host-sharded` (training with several ranks): each rank owns every N-th row (on the device or
  in host memory) and rows are exchanged per micro-batch (`comm`, `row_plan`).

Beside them: `load` (a checkpoint loaded with its tables placed), `lookahead` (the worker that gathers the next
rows while this step computes) and `table_optim` (the row-sparse table optimizers). Names load lazily:

    from stemlm.placement import Placement, choose, register
"""

from stemlm._lazy import lazy_exports

_EXPORTS = {
    "Placement": "stemlm.placement.base",
    "StoredTables": "stemlm.placement.base",
    "choose": "stemlm.placement.registry",
    "make_placement": "stemlm.placement.registry",
    "register": "stemlm.placement.registry",
    "load_offloaded_model": "stemlm.placement.load",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
