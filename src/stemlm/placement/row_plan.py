"""The routing of a sharded-table row exchange, planned on the host from every rank's input ids.

`ShardedTables.plan` learns who asks whom for which rows with collectives (a count exchange, an id exchange)
and reads the counts back from the device. When every rank holds the whole micro-batch's input ids on the CPU
(the trainer draws the global batch deterministically from (seed, step), so it does), each rank can compute
the same routing alone: for each rank s, the sorted unique ids of s's rows; s asks owner o (= id % N) for the
ones o owns, grouped by owner and ascending, and o serves them in source-rank order. This is exactly what the
collective plan produces (the same sorted `unique`, the same stable grouping), so the exchanged rows, and the
training that uses them, are bitwise the same. The work is numpy on host integers: no collective, no device
read, O(global batch tokens) per micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from stemlm.errors import StemlmError
from stemlm.model.decoder import check_token_ids


def plan_arrays(
    all_ids: Sequence[torch.Tensor], rank: int, world: int, vocab_size: int
) -> tuple[np.ndarray, list[int], list[int], np.ndarray]:
    """(positions [shape of all_ids[rank]], send_counts, recv_counts, local_rows) for this rank.

    `all_ids[s]` are rank s's input ids ([b_s, T], on the CPU); the ranks may hold different shapes.
    positions: index of each of this rank's positions among the rows it receives; send_counts[o]: unique ids
    this rank asks owner o for; recv_counts[s]: ids rank s asks this rank for; local_rows: this rank's shard rows
    to serve, grouped by requester.
    """
    if len(all_ids) != world:
        raise StemlmError(f"planning a row exchange needs the input ids of all {world} ranks, got {len(all_ids)}")
    flat = []
    for ids in all_ids:
        if ids.device.type != "cpu":
            raise StemlmError(f"host planning needs the input ids on the CPU, got {ids.device}")
        check_token_ids(ids, vocab_size)
        flat.append(ids.reshape(-1).numpy())
    uniq, inverse = np.unique(flat[rank], return_inverse=True)  # sorted, as torch.unique(sorted=True)
    owner = uniq % world
    order = np.argsort(owner, kind="stable")
    send_counts = np.bincount(owner, minlength=world).tolist()
    slot = np.empty_like(order)
    slot[order] = np.arange(order.size)  # unique id -> its row among the rows received
    positions = slot[inverse.reshape(-1)].reshape(tuple(all_ids[rank].shape))
    parts = []
    for source, ids in enumerate(flat):
        theirs = uniq if source == rank else np.unique(ids)
        parts.append(theirs[theirs % world == rank] // world)
    return positions, send_counts, [int(p.size) for p in parts], np.concatenate(parts).astype(np.int64)
