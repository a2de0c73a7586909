"""Asynchronous prefetch: one background worker fetches each step's rows while the previous step computes.

`RowPipeline` is the model's row provider (`rows={"token": pipeline}`) for offloaded tables. The caller announces a
step with `request(ids)` as soon as its ids are known (the next prefill chunk, or a token the moment it is sampled);
a single worker thread runs `RowCache.fetch` for the requests in order (plan, host gather, copy), and the
first table layer of the forward that uses those ids waits for the result. With one worker, steps are
planned and their copies issued strictly in request order, which is what lets the cache reuse slots without
racing an earlier step. On CUDA the worker issues copies on the cache's stream and the compute stream waits
on the step's event; without CUDA "device" and host are both the CPU and the same pipeline runs, with the
copies done by the worker thread (torch releases the GIL in its kernels, so they overlap with compute).

`background=False` runs each fetch on the calling thread at `request` (the synchronous reference path).
A forward whose ids were never requested fetches them on first use, so the hook also works in plain loops.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from stemlm.offload.cache import RowCache, StepRows


class _Done:
    """A finished future for the synchronous path."""

    def __init__(self, value: StepRows) -> None:
        self.value = value

    def result(self) -> StepRows:
        return self.value


class RowPipeline:
    """The row provider `(layer_idx, input_ids) -> rows` serving rows from a `RowCache`, with prefetch."""

    def __init__(self, cache: RowCache, background: bool = True) -> None:
        self.cache = cache
        self.provider = cache.provider
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stemlm-prefetch") if background else None
        self.pending: deque[tuple[torch.Tensor, Future | _Done]] = deque()
        self.current: tuple[torch.Tensor, StepRows] | None = None

    @property
    def stats(self):
        return self.cache.stats

    def request(self, ids: torch.Tensor, ids_cpu: torch.Tensor | None = None) -> None:
        """Start fetching the rows of the forward that will be called with exactly this `ids` tensor.

        `ids_cpu` (a CPU copy) saves a device->host sync when the caller already has the ids on the host.
        """
        host = ids_cpu if ids_cpu is not None else ids.detach().to("cpu")
        if self.pool is None:
            self.pending.append((ids, _Done(self.cache.fetch(host))))
        else:
            self.pending.append((ids, self.pool.submit(self.cache.fetch, host)))

    def _wait(self, job) -> StepRows:
        start = time.perf_counter()
        step = job.result()
        self.cache.stats.wait_seconds += time.perf_counter() - start
        if step.ready is not None:  # CUDA: order the compute stream after the copies, keep the memory alive for it
            stream = torch.cuda.current_stream(step.rows.device)
            stream.wait_event(step.ready)
            step.rows.record_stream(stream)
            if step.inverse is not None:
                step.inverse.record_stream(stream)
        return step

    def _step_for(self, ids: torch.Tensor) -> StepRows:
        # The model hands every table layer the same input_ids object, so identity finds the step cheaply
        # (no device sync); a value comparison is the fallback, e.g. when the model converted the ids' dtype.
        if self.pending and self.pending[0][0] is ids:
            self.current = (ids, self._wait(self.pending.popleft()[1]))
        elif self.current is not None and self.current[0] is ids:
            pass  # a later table layer of the same forward
        elif self.pending:
            if not _same_ids(self.pending[0][0], ids):
                raise RuntimeError(
                    "table rows were requested for other ids than this forward uses; call request() with the "
                    "input_ids of each forward, in forward order"
                )
            self.current = (ids, self._wait(self.pending.popleft()[1]))
        else:
            self.request(ids)
            self.current = (ids, self._wait(self.pending.popleft()[1]))
        return self.current[1]

    def __call__(self, layer_idx: int, ids: torch.Tensor) -> torch.Tensor:
        step = self._step_for(ids)
        offset, width = self.provider.layer_slices[layer_idx]
        rows = step.rows.narrow(1, offset, width)
        if step.inverse is not None:
            rows = rows.index_select(0, step.inverse)
        return rows.view(*step.shape, width)

    def drain(self) -> None:
        """Wait for every outstanding request (their lookups stay counted) and forget them."""
        while self.pending:
            self.pending.popleft()[1].result()
        self.current = None

    def close(self) -> None:
        self.drain()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None

    def __enter__(self) -> RowPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _same_ids(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.detach().to("cpu", torch.long), b.detach().to("cpu", torch.long))
