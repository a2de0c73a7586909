"""Offloaded inference: `OffloadedLM` bundles a loaded model, its table providers, row caches and the prefetching
row source, and decodes through the decoding engine (`stemlm.inference.engine.Engine`).

    from stemlm.inference.offloaded import OffloadedLM
    with OffloadedLM.load("runs/x/checkpoint", tables="host", cache_fraction=0.2) as lm:
        new_ids = lm.generate(prompt_ids, max_new_tokens=50, greedy=True)
        print(lm.summary())              # device parameter bytes, table bytes, cache statistics

Pipelining: the prompt is prefilled in chunks of `prefill_chunk` tokens and the rows of chunk i+1 are announced
before chunk i runs, and a sampled token's rows the moment it is sampled, so the transfer overlaps the layers
before the first table layer. The math is the model's own (rows are exact copies), so logits equal those of the
same checkpoint loaded with resident tables bit for bit under the same chunking; sampling is the engine's.
`forced_decode` feeds a given continuation instead of sampling (logits checks against a full forward).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from stemlm.checkpoint.folder import TOKENIZER_NAME
from stemlm.errors import StemlmError
from stemlm.inference.engine import Engine
from stemlm.inference.generate import generation_request
from stemlm.inference.inference_model import InferenceModel
from stemlm.inference.rows import RowSource
from stemlm.model.decoder import StemLM
from stemlm.offload.cache import CacheStats, RowCache, resolve_capacity
from stemlm.offload.families import OffloadProviders
from stemlm.offload.lookup_rows import LayerPipelines, LookupRows, MemoryFetcher
from stemlm.offload.prefetch import RowPipeline
from stemlm.offload.providers import TableProvider, device_parameter_bytes
from stemlm.placement.base import INFERENCE, Placement
from stemlm.placement.load import load_offloaded_model
from stemlm.placement.registry import choose

DEFAULT_PREFILL_CHUNK = 256
DEFAULT_CACHE_FRACTION = 0.2  # the operating point of the paper's blog (">80% hits with LFU")


def forced_decode(
    model: StemLM | InferenceModel,
    prompt: Sequence[int] | torch.Tensor,
    continuation: Sequence[int],
    *,
    rows: RowSource | None = None,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
) -> torch.Tensor:
    """`Engine.forced_decode` of `model` with its rows from `rows` (an `OffloadedLM.rows`; None: the model's own
    tables): the [len(continuation) + 1, V] last-position logits of every forward, on the CPU."""
    if rows is not None:
        model = InferenceModel(model, row_source=rows)
    return Engine(model, prefill_chunk=prefill_chunk).forced_decode(prompt, continuation)


class OffloadedLM:
    """A loaded model, its table provider and (for host / mmap tables) the cache and prefetch pipeline."""

    def __init__(
        self,
        model: StemLM,
        provider: TableProvider | None,
        cache: RowCache | None = None,
        background: bool = True,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        *,
        ngram_cache: RowCache | None = None,
        memory_caches: dict[int, RowCache] | None = None,
        providers: OffloadProviders | None = None,
        ngram_layer_caches: dict[int, RowCache] | None = None,
        placement: type[Placement],
    ) -> None:
        """`provider` / `cache`: the token tables; `ngram_cache` / `memory_caches`: the other families (see
        `stemlm.offload.families`), whose providers `providers` lists; `ngram_layer_caches`: the n-gram tables
        of per-layer hashing, one cache per table key (instead of `ngram_cache`); `placement`: where the tables
        are (`stemlm.placement`), for the report."""
        self.model, self.provider, self.cache, self.prefill_chunk = model, provider, cache, prefill_chunk
        self.placement = placement
        self.providers = providers or OffloadProviders(token=provider)
        self.ngram_cache, self.memory_caches = ngram_cache, memory_caches or {}
        self.ngram_layer_caches = ngram_layer_caches or {}
        token = RowPipeline(cache, background=background) if cache is not None else None
        ngram = RowPipeline(ngram_cache, background=background) if ngram_cache is not None else None
        if self.ngram_layer_caches:
            pipelines = {k: RowPipeline(c, background=background) for k, c in self.ngram_layer_caches.items()}
            ngram = LayerPipelines(model, pipelines)
        memory = MemoryFetcher(self.memory_caches) if self.memory_caches else None
        self.rows = LookupRows(model, token, ngram, memory)  # the row source of every forward

    @classmethod
    def load(
        cls,
        directory: str | Path,
        tables: str = "host",
        *,
        cache_rows: int | None = None,
        cache_fraction: float | None = None,
        policy: str = "lfu",
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        layout: str = "token",
        warm_counts=None,
        background: bool = True,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        table_dtype: str | None = None,
    ) -> OffloadedLM:
        """Load a checkpoint; host / mmap tables get a cache of `cache_rows` rows or `cache_fraction` of the
        vocabulary (DEFAULT_CACHE_FRACTION when neither is given; 0 rows stages every row per step)."""
        placement = choose(tables, INFERENCE)
        model, providers = load_offloaded_model(
            directory, tables, device=device, dtype=dtype, layout=layout, table_dtype=table_dtype
        )
        model.eval()
        caches: dict[str, RowCache | None] = {"token": None, "ngram": None}
        memory: dict[int, RowCache] = {}
        ngram_layers: dict[int, RowCache] = {}
        if placement.offloaded:
            if cache_rows is None and cache_fraction is None:
                cache_fraction = DEFAULT_CACHE_FRACTION

            fraction = cache_fraction
            if fraction is None:  # sized in token rows: the other families get the same fraction of their rows
                base = providers.token.vocab_size if providers.token is not None else model.config.vocab_size
                fraction = min(1.0, cache_rows / base)

            def cache_for(provider, rows=None, warm=None) -> RowCache:
                capacity = resolve_capacity(provider.vocab_size, rows, None if rows is not None else fraction)
                return RowCache(provider, capacity, policy, device=device, warm_counts=warm)

            if providers.token is not None:
                caches["token"] = cache_for(providers.token, cache_rows, warm_counts)
            if providers.ngram is not None:
                caches["ngram"] = cache_for(providers.ngram)
            memory = {i: cache_for(p) for i, p in providers.memory.items()}
            ngram_layers = {i: cache_for(p) for i, p in providers.ngram_layers.items()}
        return cls(
            model,
            providers.token,
            caches["token"],
            background=background,
            prefill_chunk=prefill_chunk,
            ngram_cache=caches["ngram"],
            memory_caches=memory,
            providers=providers,
            ngram_layer_caches=ngram_layers,
            placement=placement,
        )

    def inference_model(self, amp: torch.dtype = torch.float32) -> InferenceModel:
        """The model with these rows under autocast `amp` (what `stemlm.inference.load` serves)."""
        return InferenceModel(self.model, amp=amp, row_source=self.rows)

    def engine(self, model: InferenceModel | None = None, **settings) -> Engine:
        """The decoding engine over `model` (default: `inference_model()`), prefilling in `prefill_chunk` chunks."""
        return Engine(model or self.inference_model(), prefill_chunk=self.prefill_chunk, **settings)

    def stream(self, input_ids, max_new_tokens: int, **sampling) -> Iterator[int]:
        """`stemlm.inference.generate.stream_tokens` keywords (sampling, seed, eos_id) on these tables."""
        return self.engine().stream(generation_request(input_ids, max_new_tokens, **sampling))

    def generate(self, input_ids, max_new_tokens: int, **sampling) -> list[int]:
        return list(self.stream(input_ids, max_new_tokens, **sampling))

    def stats(self) -> CacheStats | None:
        return None if self.cache is None else self.cache.stats

    def family_caches(self) -> dict[str, RowCache]:
        """Every row cache by family name: token, ngram, ngram.<key> (per-layer hashing), memory.<layer>."""
        named = {"token": self.cache, "ngram": self.ngram_cache}
        named.update({f"ngram.{i}": c for i, c in self.ngram_layer_caches.items()})
        named.update({f"memory.{i}": c for i, c in self.memory_caches.items()})
        return {name: cache for name, cache in named.items() if cache is not None}

    def memory(self) -> dict[str, int | str]:
        """Where the bytes are: device parameters (tables excluded unless resident), tables, device cache."""
        table_bytes = sum(p.table_bytes for p in self.providers.all().values())
        caches = self.family_caches().values()
        return {
            "placement": self.placement.name,
            "device_parameter_bytes": device_parameter_bytes(self.model),
            "table_bytes": table_bytes,
            **self.placement.byte_counts(table_bytes),
            "cache_device_bytes": sum(c.device_bytes for c in caches),
            "cache_rows": sum(c.capacity for c in caches),
        }

    def report(self) -> dict:
        """Memory figures and (offloaded tables) cache statistics, JSON-ready."""
        stats = self.stats()
        out = {
            **self.memory(),
            "cache": None if stats is None else {**stats.to_dict(), "policy": self.cache.policy.policy},
        }
        others = {name: c for name, c in self.family_caches().items() if name != "token"}
        if others:
            out["family_caches"] = {name: {**c.stats.to_dict(), "capacity": c.capacity} for name, c in others.items()}
            if self.rows.memory is not None:
                out["memory_on_demand_wait_s"] = self.rows.memory.wait_seconds
        return out

    def summary(self) -> str:
        """Human-readable memory figures and cache statistics (one line each)."""
        m = self.memory()
        lines = [
            f"memory: device parameters {m['device_parameter_bytes'] / 2**20:.2f} MiB, tables {self.placement.where} "
            f"{m['table_bytes'] / 2**20:.2f} MiB, device cache {m['cache_rows']} rows "
            f"({m['cache_device_bytes'] / 2**20:.2f} MiB)"
        ]
        for name, cache in self.family_caches().items():
            label = "" if name == "token" else f"{name} rows: "
            lines.append(f"{label}{cache.policy.policy} {cache.stats.summary()}")
        if self.rows.memory is not None:
            lines.append(
                f"memory rows fetched on demand (ids known only after each memory layer's top-k): "
                f"{self.rows.memory.wait_seconds:.3f} s on the critical path"
            )
        return "\n".join(lines)

    def close(self) -> None:
        self.rows.close()

    def __enter__(self) -> OffloadedLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_checkpoint(path: str | Path, tables: str = "host", **load_kwargs) -> tuple[OffloadedLM, object]:
    """`OffloadedLM.load` for a CKPT argument (checkpoint or run folder), plus its tokenizer (or None)."""
    from stemlm.checkpoint.runs import check_tokenizer_fits, resolve_checkpoint
    from stemlm.data.tokenizer import load_tokenizer
    from stemlm.runtime import check_device

    check_device(load_kwargs.get("device", "cpu"))
    folder = resolve_checkpoint(path)
    tokenizer = load_tokenizer(folder) if (folder / TOKENIZER_NAME).is_file() else None
    lm = OffloadedLM.load(folder, tables, **load_kwargs)
    if tokenizer is not None:
        try:
            check_tokenizer_fits(tokenizer.get_vocab_size(), lm.model.config.vocab_size, folder)
        except StemlmError:
            lm.close()
            raise
    return lm, tokenizer
