"""The host-planned row exchange (stemlm.placement.row_plan) routes every id to its row, for any number of ranks.

No process group: the plans of all N ranks are computed here and the all_to_all is simulated with plain
slicing (owner o serves global row `local * N + o`). Each rank must then read exactly its input ids back, and
what a rank sends must be what its peer expects. The 2-rank equality with the collective plan is in
tests/train/parallel/test_row_exchange.py. Run: `python -m pytest tests/placement/test_row_plan.py -q`.
"""

from __future__ import annotations

import pytest
import torch

from stemlm.errors import StemlmError
from stemlm.placement.row_plan import plan_arrays


def simulate(all_ids: list[torch.Tensor], world: int, vocab: int) -> list[torch.Tensor]:
    plans = [plan_arrays(all_ids, rank, world, vocab) for rank in range(world)]
    for rank, (_, send, _, _) in enumerate(plans):
        assert send == [plans[owner][2][rank] for owner in range(world)]  # my send count = the owner's recv count
    received = []
    for rank, (positions, send, _, _) in enumerate(plans):
        rows = []
        for owner in range(world):
            _, _, recv, local_rows = plans[owner]
            start = sum(recv[:rank])
            served = torch.from_numpy(local_rows[start : start + recv[rank]]) * world + owner  # global ids served
            assert served.numel() == send[owner]
            rows.append(served)
        got = torch.cat(rows)
        assert got.unique().numel() == got.numel()  # each unique id is asked for once
        received.append(got[torch.from_numpy(positions)])
    return received


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_every_rank_reads_its_own_ids(world):
    gen = torch.Generator().manual_seed(world)
    vocab = 97
    all_ids = [torch.randint(0, vocab, (1 + r % 2, 13), generator=gen) for r in range(world)]
    all_ids[0][0, :4] = 3 * world  # repeats, and one owner's ids only in places
    for ids, got in zip(all_ids, simulate(all_ids, world, vocab), strict=True):
        assert torch.equal(got, ids)


def test_a_rank_asking_nobody_and_an_owner_serving_nothing():
    all_ids = [torch.full((2, 3), 4), torch.tensor([[2, 6, 8]])]  # only even ids: owner 1 serves nothing
    got = simulate(all_ids, 2, 10)
    assert torch.equal(got[0], all_ids[0]) and torch.equal(got[1], all_ids[1])
    _, send, recv, local_rows = plan_arrays(all_ids, 1, 2, 10)
    assert send == [3, 0] and recv == [0, 0] and local_rows.size == 0


def test_bad_input_is_named():
    with pytest.raises(StemlmError, match="input ids of all 2 ranks"):
        plan_arrays([torch.zeros(1, 2, dtype=torch.long)], 0, 2, 10)
    with pytest.raises(StemlmError, match="out of range|outside|vocab"):
        plan_arrays([torch.tensor([[1, 10]]), torch.tensor([[0]])], 0, 2, 10)
