"""The row hooks of a model whose lookup tables are offloaded: token rows, n-gram rows and memory rows.

`LookupRows` is what the offloaded engine hands the model (`rows()` -> the forward's `rows={family: provider}`
mapping) and what it announces each step to (`request(ids)`), in forward order:

- token rows: a `RowPipeline` over the token-table cache, requested with the step's ids (unchanged);
- n-gram rows: a second `RowPipeline` over the n-gram cache. `request` hashes the step's ids with the ids
  seen before them in this sequence (kept here on the host, reset by `begin_sequence`) into exactly the
  n-gram ids the model will compute, so their rows are prefetched like token rows;
- memory rows: `MemoryFetcher`, which fetches a memory layer's value rows when the layer has computed its
  top-k ids. That read sits on the critical path: it costs a device->host copy of the ids (a sync on CUDA),
  the cache planning and the host gather of the misses before the layer can continue, once per memory layer
  and step; `wait_seconds` records that time (for token and n-gram rows it is only the part of the fetch
  that prefetch could not hide).
"""

from __future__ import annotations

import time

import torch

from stemlm.model.decoder import StemLM
from stemlm.offload.cache import RowCache
from stemlm.offload.prefetch import RowPipeline


class MemoryFetcher:
    """The `memory` row provider `(layer_idx, ids) -> (rows [U, d], positions)`: one row cache per memory layer."""

    def __init__(self, caches: dict[int, RowCache]) -> None:
        self.caches = caches
        self.wait_seconds = 0.0

    def __call__(self, layer_idx: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start = time.perf_counter()
        step = self.caches[layer_idx].fetch(ids.detach().to("cpu"))
        if step.ready is not None:
            stream = torch.cuda.current_stream(step.rows.device)
            stream.wait_event(step.ready)
            step.rows.record_stream(stream)
        positions = step.inverse
        if positions is None:  # distinct ids in order: row k is position k
            positions = torch.arange(ids.numel(), device=step.rows.device)
        self.wait_seconds += time.perf_counter() - start
        return step.rows, positions.view(ids.shape)


class LookupRows:
    """Every offloaded family's hook for one model; `request` each forward's ids, in forward order."""

    def __init__(
        self,
        model: StemLM,
        token: RowPipeline | None = None,
        ngram: RowPipeline | None = None,
        memory: MemoryFetcher | None = None,
    ) -> None:
        self.hasher = model.ngram_hasher
        self.token, self.ngram, self.memory = token, ngram, memory
        self.seen: torch.Tensor | None = None  # host ids of this sequence so far (n-gram context)

    @property
    def stats(self):
        """The token-row cache statistics (the n-gram and memory caches report through `family_stats`)."""
        return None if self.token is None else self.token.stats

    def begin_sequence(self) -> None:
        self.seen = None

    def request(self, ids: torch.Tensor, ids_cpu: torch.Tensor | None = None) -> None:
        host = ids_cpu if ids_cpu is not None else ids.detach().to("cpu")
        if self.token is not None:
            self.token.request(ids, host)
        if self.ngram is not None:
            prev = host.new_full((host.shape[0], self.hasher.context), -1)
            if self.seen is not None:
                take = min(self.hasher.context, self.seen.shape[1])
                prev[:, self.hasher.context - take :] = self.seen[:, self.seen.shape[1] - take :]
            keys = self.hasher.ids(host, prev)
            self.ngram.request(keys.to(ids.device), keys)  # the forward's own ids match these by value
        self.seen = host if self.seen is None else torch.cat([self.seen, host], dim=1)

    def __call__(self, layer_idx: int, ids: torch.Tensor) -> torch.Tensor:
        return self.token(layer_idx, ids)

    def rows(self) -> dict:
        """The forward's `rows=` mapping: a provider per offloaded family."""
        found = {"token": self if self.token is not None else None, "ngram": self.ngram, "memory": self.memory}
        return {family: provider for family, provider in found.items() if provider is not None}

    def drain(self) -> None:
        for pipeline in (self.token, self.ngram):
            if pipeline is not None:
                pipeline.drain()

    def close(self) -> None:
        for pipeline in (self.token, self.ngram):
            if pipeline is not None:
                pipeline.close()
