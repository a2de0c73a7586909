"""The resident training placement (`--tables device`, the default; "resident" in the inference commands): the
token tables stay in the model as ordinary parameters on the compute device, read by the model's own lookup and
stepped by the recipe's table optimizer, so every hook of `TablePlacement` is its default (nothing to do).
A model without token tables trains with this placement at any world size. Tests: tests/train/tables/test_placement.py.
"""

from __future__ import annotations

from stemlm.train.tables.placement import TablePlacement


class ResidentTables(TablePlacement):
    """The tables are the model's parameters: no rows to supply, no gradients to finish, the optimizer unwrapped."""

    name = "resident"
