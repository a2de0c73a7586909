"""Background prefetching of training micro-batches: the next windows are read while the current one trains.

    batches = BatchPrefetcher(lambda w: data.sample_batch(8, 256, seed=0, step=w), device, ahead=2, end=steps)
    x, y = batches.get(window)     # on the device; windows window+1 .. window+ahead are being read meanwhile
    batches.close()

A micro-batch is a pure function of its window number (`sample_batch(seed, step=window)`), so reading it early
on another thread changes nothing about which tokens a step sees: a run with prefetching, without it, or resumed
at any step reads the same batches (tests/train/test_prefetch.py checks all three bitwise). One worker thread
runs the gathers (numpy memmap reads, which release the GIL); `get` returns the batch of the window asked for,
reading it on the spot if it was not scheduled (a resume, an evaluation in between), and drops any window
scheduled that is no longer wanted.

On CUDA the worker copies each batch into page-locked memory (`Tensor.pin_memory()`, served from torch's
caching host allocator, which keeps a block from reuse until the copies that read it have finished) and `get`
moves it with `non_blocking=True`, so the host-to-device copy runs on the stream asynchronously with the host.
Elsewhere (CPU) the same code runs with plain tensors and a plain `.to(device)`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

Batch = tuple[torch.Tensor, torch.Tensor]


class BatchPrefetcher:
    """Reads micro-batches `window + 1 .. window + ahead` on a worker thread while `window` trains."""

    def __init__(
        self,
        sample: Callable[[int], Batch],
        device: torch.device,
        *,
        ahead: int = 2,
        end: int | None = None,
        pin: bool | None = None,
    ) -> None:
        """`pin` (default: `device` is CUDA) page-locks the batches; with `device` the CPU they stay on the host,
        pinned, for a caller that moves parts of them itself (a rank's rows of the global batch)."""
        self.sample, self.device, self.ahead, self.end = sample, device, ahead, end
        self.pin = device.type == "cuda" if pin is None else pin
        self.pending: dict[int, Future[Batch]] = {}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stemlm-prefetch") if ahead > 0 else None

    def _read(self, window: int) -> Batch:
        x, y = self.sample(window)
        return (x.pin_memory(), y.pin_memory()) if self.pin else (x, y)

    def get(self, window: int) -> Batch:
        """Micro-batch `window` as (inputs, targets) on the device; schedules the next `ahead` windows."""
        future = self.pending.pop(window, None)
        for stale in [w for w in self.pending if w < window]:  # a window skipped over is never asked for again
            self.pending.pop(stale).cancel()
        if self.pool is not None:
            last = window + self.ahead if self.end is None else min(window + self.ahead, self.end - 1)
            for nxt in range(window + 1, last + 1):
                if nxt not in self.pending:
                    self.pending[nxt] = self.pool.submit(self._read, nxt)
        x, y = future.result() if future is not None else self._read(window)
        return x.to(self.device, non_blocking=self.pin), y.to(self.device, non_blocking=self.pin)  # no-op on host

    def close(self) -> None:
        """Drop what was read ahead and stop the worker thread."""
        for future in self.pending.values():
            future.cancel()
        self.pending.clear()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
