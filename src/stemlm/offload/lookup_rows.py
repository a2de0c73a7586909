"""The row source of a model whose lookup tables are offloaded: token rows, n-gram rows and memory rows.

`LookupRows` is the `stemlm.inference.rows.RowSource` of host and memory-mapped tables: `providers()` is the
forward's `rows={family: provider}` mapping, and the engine announces each forward's ids to it
(`announce(ids, host, before)`), in forward order:

- token rows: a `RowPipeline` over the token-table cache, requested with the forward's ids;
- n-gram rows: a second `RowPipeline` over the n-gram cache. `announce` hashes each row's ids with the ids
  before them (`before`, from the engine, which knows every sequence) into exactly the n-gram ids the model
  will compute, so their rows are prefetched like token rows. Per-layer hashing (`engram_variant=reference`)
  gives every n-gram layer its own ids and table: `LayerPipelines`, one pipeline per table, each announced
  with its layer's ids;
- memory rows: `MemoryFetcher`, which fetches a memory layer's value rows when the layer has computed its
  top-k ids. That read sits on the critical path: it costs a device->host copy of the ids (a sync on CUDA),
  the cache planning and the host gather of the misses before the layer can continue, once per memory layer
  and step; `wait_seconds` records that time (for token and n-gram rows it is only the part of the fetch
  that prefetch could not hide).
A forward whose rows were never announced (a scoring call) fetches them on first use.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from stemlm.model.decoder import StemLM
from stemlm.model.kinds.registry import key_layer
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


class LayerPipelines:
    """The `ngram` row provider `(key, ids) -> rows` of per-layer hashing: one `RowPipeline` (and cache) per
    n-gram table, by table key; `request` takes the hasher's ids per layer."""

    def __init__(self, model: StemLM, pipelines: dict[int, RowPipeline]) -> None:
        self.pipelines = pipelines
        # one n-gram table per layer (one n-gram kind per model): the layer's ids go to that table's pipeline
        self.key_of_layer = {key_layer(model.config, key): key for key in pipelines}

    def request(self, ids_by_layer: dict[int, torch.Tensor], device: torch.device) -> None:
        for layer, ids in ids_by_layer.items():
            self.pipelines[self.key_of_layer[layer]].request(ids.to(device), ids)

    def __call__(self, key: int, ids: torch.Tensor) -> torch.Tensor:
        return self.pipelines[key](key, ids)

    def drain(self) -> None:
        for pipeline in self.pipelines.values():
            pipeline.drain()

    def close(self) -> None:
        for pipeline in self.pipelines.values():
            pipeline.close()


class LookupRows:
    """Every offloaded family's provider for one model; `announce` each forward's ids, in forward order."""

    def __init__(
        self,
        model: StemLM,
        token: RowPipeline | None = None,
        ngram: RowPipeline | LayerPipelines | None = None,
        memory: MemoryFetcher | None = None,
    ) -> None:
        self.hasher = model.ngram_hasher
        self.token, self.ngram, self.memory = token, ngram, memory

    @property
    def stats(self):
        """The token-row cache statistics (the n-gram and memory caches report through `family_stats`)."""
        return None if self.token is None else self.token.stats

    def announce(self, ids: torch.Tensor, host: torch.Tensor, before: Sequence[Sequence[int]]) -> None:
        """Start fetching the rows of the forward that will run on exactly `ids` ([B, T]; `host` its CPU copy);
        `before[b]`: the ids of row b before these (the n-gram keys' context)."""
        if self.token is not None:
            self.token.request(ids, host)
        if self.ngram is not None:
            context = self.hasher.context
            prev = host.new_full((host.shape[0], context), -1)
            for b, earlier in enumerate(before):
                tail = list(earlier[-context:])
                if tail:
                    prev[b, context - len(tail) :] = torch.tensor(tail)
            keys = self.hasher.ids(host, prev)
            if isinstance(keys, dict):  # per-layer hashing: each table its own ids
                self.ngram.request(keys, ids.device)
            else:
                self.ngram.request(keys.to(ids.device), keys)  # the forward's own ids match these by value

    def providers(self) -> dict:
        """The forward's `rows=` mapping: a provider per offloaded family."""
        found = {"token": self.token, "ngram": self.ngram, "memory": self.memory}
        return {family: provider for family, provider in found.items() if provider is not None}

    def drain(self) -> None:
        for pipeline in (self.token, self.ngram):
            if pipeline is not None:
                pipeline.drain()

    def close(self) -> None:
        for pipeline in (self.token, self.ngram):
            if pipeline is not None:
                pipeline.close()
