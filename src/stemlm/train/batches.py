"""The micro-batches of a run as one rank sees them: `MicroBatches.get(window)` is micro-batch `window` of the
global batch, this rank's rows of it, on the rank's device, read ahead on a worker thread (stemlm.train.prefetch).

    batches = MicroBatches(train_data, cfg, world, every_rank=False)
    x, y = batches.get(window)       # [batch_size / world size, seq_len] on the device
    batches.close()

The global batch is the 1-process batch at any world size: micro-batch `window` is the `sample_batch(seed,
step=window)` draw and rank r takes rows [r * b, (r + 1) * b), b = batch_size / N. A rank reads only its rows,
unless the table placement plans its row exchange from every rank's ids (`every_rank`, row-sharded tables): then
each rank reads the whole micro-batch on the host once (`rank_ids` hands every rank's input ids to the placement)
and moves its own rows to the device.
"""

from __future__ import annotations

from typing import Any

import torch

from stemlm.train.config import TrainConfig

Batch = tuple[torch.Tensor, torch.Tensor]


class MicroBatches:
    """Micro-batch `window` of a run, this rank's rows of it on the device; read ahead while the current trains."""

    def __init__(self, data: Any, cfg: TrainConfig, world: Any, local_batch: int, *, every_rank: bool) -> None:
        self.data, self.cfg, self.world, self.local_batch = data, cfg, world, local_batch
        self.every_rank = every_rank
        self.rows = slice(world.rank * local_batch, (world.rank + 1) * local_batch)
        self.prefetcher = None  # built at the first micro-batch (its end is the run's last window)
        self._global: dict[int, Batch] = {}  # whole micro-batches read for `every_rank`, until used

    def sample(self, window: int) -> Batch:
        """Micro-batch `window` read on the host now: this rank's rows (every rank's with `every_rank`)."""
        cfg = self.cfg
        rows = None if self.every_rank or self.world.size == 1 else self.rows
        return self.data.sample_batch(cfg.batch_size, cfg.seq_len, seed=cfg.seed, step=window, rows=rows)

    def ids(self, window: int) -> torch.Tensor:
        """The input ids of micro-batch `window` on the host, read again (not taken from the read-ahead)."""
        return self.sample(window)[0]

    def get(self, window: int) -> Batch:
        """Micro-batch `window` (this rank's rows) on the device, the next ones being read meanwhile."""
        if not self.every_rank:
            return self._prefetched(window, self.world.device)
        x, y = (t[self.rows] for t in self._global.pop(window, None) or self._whole(window))
        pinned = self.world.device.type == "cuda"  # row views of the prefetcher's pinned global batch
        return x.to(self.world.device, non_blocking=pinned), y.to(self.world.device, non_blocking=pinned)

    def rank_ids(self, window: int) -> list[torch.Tensor]:
        """Every rank's input ids of micro-batch `window`, on the host (`every_rank` only)."""
        return list(self._whole(window)[0].split(self.local_batch))

    def _whole(self, window: int) -> Batch:
        """The whole micro-batch `window` on the host, read once for both its ids and this rank's rows."""
        if window not in self._global:
            for old in [w for w in self._global if w < window - self.cfg.grad_accum]:
                del self._global[old]  # windows of a step cut short, or long gone
            self._global[window] = self._prefetched(window, torch.device("cpu"))  # read ahead, pinned on CUDA
        return self._global[window]

    def _prefetched(self, window: int, device: torch.device) -> Batch:
        if self.prefetcher is None:
            from stemlm.train.prefetch import BatchPrefetcher

            cfg, pin = self.cfg, self.world.device.type == "cuda"
            end = cfg.steps * cfg.grad_accum
            self.prefetcher = BatchPrefetcher(self.sample, device, ahead=cfg.prefetch, end=end, pin=pin)
        return self.prefetcher.get(window)

    def close(self) -> None:
        """Stop reading ahead (a later `get` starts again)."""
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None
