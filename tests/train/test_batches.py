"""A rank's micro-batches: rank r of N gets rows [r * b, (r + 1) * b) of the 1-process micro-batch (b = B / N), read
alone or, when its table placement plans from every rank's ids, cut from the whole micro-batch it read once.
Run: `python -m pytest tests/train/test_batches.py -q`.
"""

from __future__ import annotations

import torch

from stemlm.train.batches import MicroBatches
from stemlm.train.config import TrainConfig
from stemlm.train.world import DistributedWorld, LocalWorld
from tests.placement.test_placement import Windows

CPU = torch.device("cpu")


def test_every_rank_takes_its_rows_of_the_one_process_micro_batch():
    cfg = TrainConfig(batch_size=4, seq_len=8, steps=3, prefetch=2, device="cpu")
    whole = MicroBatches(Windows(), cfg, LocalWorld(CPU), 4, every_rank=False)
    for every_rank in (False, True):
        for rank in range(2):
            part = MicroBatches(Windows(), cfg, DistributedWorld(CPU, rank, 2), 2, every_rank=every_rank)
            for window in (0, 1, 2, 1):  # read ahead, then a window asked for again (a resume, an evaluation)
                x, y = part.get(window)
                want_x, want_y = whole.get(window)
                assert torch.equal(x, want_x[2 * rank : 2 * rank + 2]) and torch.equal(
                    y, want_y[2 * rank : 2 * rank + 2]
                )
                if every_rank:
                    assert [t.tolist() for t in part.rank_ids(window)] == [t.tolist() for t in want_x.split(2)]
            part.close()
            assert part.prefetcher is None
    assert torch.equal(whole.ids(1), whole.get(1)[0])
    whole.close()
