"""The resident placement (`--tables device`, the default; `resident` names it too): the tables stay in the model
as ordinary parameters on the compute device. In training the model's own lookup reads them and the recipe's
table optimizer steps them, so every hook is `Placement`'s default (nothing to do); in inference the model is
loaded whole, nothing is offloaded, and decoding may be compiled. A model without token tables trains with this
placement at any world size. Tests: tests/placement/test_placement.py.
"""

from __future__ import annotations

from stemlm.placement.base import Placement


class ResidentTables(Placement):
    """The tables are the model's parameters: no rows to supply, no gradients to finish, the optimizer unwrapped."""

    name = "resident"
    tables = "device"
    aliases = ("resident",)
    where = "on the device"
    compiles = True
