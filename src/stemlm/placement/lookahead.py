"""The one background thread of host-resident tables (1 process and row shards): gathers and table updates run
on it in FIFO order, and it keeps the two times whose ratio says how much of that work the trainer never waited
for (the `overlap` of the train summary and `benchmarks/host_train.py`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class LookaheadWorker:
    """Mixin: `_start_worker(name)` in `__init__`, then `_timed(fn, *args)` queues work, `_wait(future)` waits."""

    def _start_worker(self, name: str) -> None:
        self.worker = ThreadPoolExecutor(1, thread_name_prefix=name)
        self.work_s = self.wait_s = 0.0  # seconds the worker ran jobs / the trainer's thread waited for them

    def _timed(self, fn: Callable, *args) -> Future:
        def job():
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.work_s += time.perf_counter() - start

        return self.worker.submit(job)

    def _wait(self, future: Future):
        start = time.perf_counter()
        try:
            return future.result()
        finally:
            self.wait_s += time.perf_counter() - start

    def sync(self) -> None:
        """Wait until every queued table update and gather has run."""
        self._wait(self.worker.submit(lambda: None))

    def overlap(self) -> float | None:
        """The share of the worker's time the trainer did not wait for (None before any work)."""
        return None if self.work_s == 0 else max(0.0, 1.0 - self.wait_s / self.work_s)
