"""Table placements (stemlm.runtime): one set of names for training and inference, "resident" the same as "device"."""

from __future__ import annotations

import pytest

from stemlm.errors import StemlmError
from stemlm.runtime import TRAINING_PLACEMENTS, placement_choices, table_placement
from stemlm.train.config import TrainConfig


def test_resident_and_device_are_one_placement():
    assert table_placement("resident") == table_placement("device") == "device"
    assert table_placement("mmap") == "mmap"
    assert TrainConfig(tables="resident").tables == "device"
    assert placement_choices(TRAINING_PLACEMENTS) == ("device", "host", "resident")


def test_unknown_or_unallowed_placements_are_one_line_errors():
    with pytest.raises(StemlmError, match=r"placement 'disk'; choose one of device \(or resident\), host, mmap$"):
        table_placement("disk")
    with pytest.raises(StemlmError, match="unknown table placement 'mmap'; choose one of device .or resident., host$"):
        table_placement("mmap", TRAINING_PLACEMENTS)
    with pytest.raises(StemlmError, match="tables must be one of device, host, got 'mmap'"):
        TrainConfig(tables="mmap")
