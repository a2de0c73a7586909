"""The closed sets of values a setting takes, each written once: the config that validates a value, the library
function that checks it and the command-line flag that offers it all read the tuple here.

It sits at the package's lowest layer and imports nothing, so a CLI parser can show the choices without loading
torch, and any package may read them. A set that belongs to a registry stays with its registry (the FFN kinds:
`stemlm.model.kinds.registry`; the table placements and their synonyms: `stemlm.placement.registry`).
`tests/test_choices.py` checks that no tuple here is written out again in `src/`.
"""

from __future__ import annotations

# Compute precision under autocast (`--dtype`); weights keep their own dtype. auto: stemlm.runtime.resolve_dtype.
COMPUTE_DTYPES = ("auto", "fp32", "bf16")
# The formats a lookup table's rows are stored in (stemlm.checkpoint.table_storage): the compact ones, and fp32.
COMPACT_TABLE_DTYPES = ("bf16", "int8")
TABLE_DTYPES = ("fp32", *COMPACT_TABLE_DTYPES)
DEVICES = ("auto", "cpu", "cuda")  # a training run's device; auto: cuda when available
PARALLEL_MODES = ("ddp", "fsdp")  # the backbone of a multi-process run: replicated, or sharded per layer (FSDP2)
RECIPES = ("stemlm", "official")  # the update's rules around the model (stemlm.train.recipes)
# How the fact world's statements join the embedded corpus (stemlm.data.fact_mix): 64 to a document after the
# corpus with every batch holding its share of fact windows; a line each spread through the text; or 64 to a
# document drawn like any other text (runs made before the field existed).
FACT_LAYOUTS = ("batches", "lines", "documents")
SAMPLING = ("auto", "epoch", "uniform")  # training window order (stemlm.train.config: TrainConfig.sampling)
TRAINABLE = ("all", "tables")  # the parameters that learn: all, or only the token tables
KEEP_OPTIMIZER_STATE = ("newest", "all")  # the checkpoints that keep their optimizer state
CACHE_POLICIES = ("lfu", "lru")  # replacement policies of the hot-row table cache (stemlm.offload.cache)
EDIT_ROWS = ("tables", "embed", "both")  # the rows a row-swap edit replaces: token-table rows, embedding rows, both
EDIT_ROW_ALIASES = {"stem": "tables"}  # old names of EDIT_ROWS values, accepted wherever a row kind is read
EDIT_MODES = ("positional", "global")  # an edit of the prompt's span, or of the source tokens everywhere
RETROFIT_INITS = ("embed", "normed", "calib")  # a retrofitted table's start (stemlm.convert.retrofit)
# The token tables' optimizers (stemlm.placement.table_optim); the row-sparse ones update only the rows a step touched,
# which every placement off the device needs (its rows come and go per micro-batch).
ROW_SPARSE_OPTIMIZERS = ("lazy_adamw", "rowwise_adagrad")
TABLE_OPTIMIZERS = ("adamw", *ROW_SPARSE_OPTIMIZERS)


def edit_row_kind(rows):
    """The row kind `rows` names: an old name (`EDIT_ROW_ALIASES`) read as its new one, anything else unchanged."""
    return EDIT_ROW_ALIASES.get(rows, rows) if isinstance(rows, str) else rows
