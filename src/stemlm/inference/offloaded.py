"""Offloaded inference: prefill in chunks and decode with each step's table rows prefetched through the
hot-row cache, and `OffloadedLM`, which bundles a loaded model, its table provider, cache and pipeline.

    from stemlm.offload import OffloadedLM
    with OffloadedLM.load("runs/x/checkpoint", tables="host", cache_fraction=0.2) as lm:
        new_ids = lm.generate(prompt_ids, max_new_tokens=50, greedy=True)
        print(lm.summary())              # device parameter bytes, table bytes, cache statistics

Pipelining: the rows of prefill chunk i+1 are requested before chunk i runs, and a sampled token's rows the
moment it is sampled, so the transfer overlaps the layers before the first table layer. The math is the
model's own (rows are exact copies), so logits equal those of the same checkpoint loaded with resident
tables bit for bit under the same chunking; sampling matches `stemlm.inference.generate` (same filters and seeding).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from stemlm.checkpoint.folder import TOKENIZER_NAME
from stemlm.errors import StemlmError
from stemlm.inference.generate import check_sampling, sample_token
from stemlm.model.decoder import StemLM
from stemlm.offload.cache import CacheStats, RowCache, resolve_capacity
from stemlm.offload.families import OffloadProviders, load_offloaded_model
from stemlm.offload.lookup_rows import LookupRows, MemoryFetcher
from stemlm.offload.prefetch import RowPipeline
from stemlm.offload.providers import TableProvider, device_parameter_bytes
from stemlm.runtime import DEVICE, table_placement

DEFAULT_PREFILL_CHUNK = 256
DEFAULT_CACHE_FRACTION = 0.2  # the operating point of the paper's blog (">80% hits with LFU")


# ----------------------------------------------------------------------------------------------------------
# prefill and decoding
# ----------------------------------------------------------------------------------------------------------
def _forward(model: StemLM, ids: torch.Tensor, kv, rows: RowPipeline | LookupRows | None):
    providers = rows.rows() if isinstance(rows, LookupRows) else {"token": rows}
    with torch.no_grad():
        out = model(ids, past_key_values=kv, use_cache=True, rows=providers)
    return out.logits[0, -1], out.past_key_values


def prefill(model: StemLM, prompt: torch.Tensor, rows: RowPipeline | None, chunk: int = DEFAULT_PREFILL_CHUNK):
    """Run a [1, P] prompt (a CPU tensor) in chunks of `chunk` tokens; the rows of chunk i+1 are requested
    before chunk i runs. Returns (logits of the last position, KV cache)."""
    if chunk < 1:
        raise StemlmError(f"prefill chunk must be >= 1 token, got {chunk}")
    prompt = prompt.cpu()
    host_chunks = prompt.split(chunk, dim=1)  # requests read these: no device->host sync while chunks compute
    chunks = prompt.to(model.model.embed_tokens.weight.device).split(chunk, dim=1)
    if isinstance(rows, LookupRows):
        rows.begin_sequence()  # n-gram keys of the first chunk see no earlier ids
    if rows is not None:
        rows.request(chunks[0], host_chunks[0])
    logits, kv = None, None
    for i, ids in enumerate(chunks):
        if rows is not None and i + 1 < len(chunks):
            rows.request(chunks[i + 1], host_chunks[i + 1])
        logits, kv = _forward(model, ids, kv, rows)
    return logits, kv


def _prompt(model: StemLM, input_ids) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)
    if ids.numel() == 0:
        raise StemlmError("the prompt is empty: generation needs at least one token to start from")
    if ids.shape[1] >= model.config.max_position_embeddings:
        raise StemlmError(
            f"the prompt has {ids.shape[1]} tokens, which leaves no room to generate within "
            f"max_position_embeddings={model.config.max_position_embeddings}; shorten it"
        )
    return ids


def stream_generate(
    model: StemLM,
    input_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    *,
    rows: RowPipeline | None = None,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    greedy: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
    logits_out: list[torch.Tensor] | None = None,
) -> Iterator[int]:
    """New token ids, each yielded as soon as it is sampled; `rows=None` uses the model's own tables.

    Sampling matches `stemlm.inference.generate` (same filters, same seeded generator). `logits_out`, when given,
    receives a CPU copy of the logits each token was sampled from.
    """
    check_sampling(temperature, top_k, top_p)
    if max_new_tokens < 0:
        raise StemlmError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    device = model.model.embed_tokens.weight.device
    prompt_cpu = _prompt(model, input_ids)
    budget = min(max_new_tokens, model.config.max_position_embeddings - prompt_cpu.shape[1])
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    sample = dict(greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    return _decode(model, prompt_cpu, budget, rows, prefill_chunk, sample, eos_id, logits_out)


def _decode(model, prompt_cpu, budget, rows, prefill_chunk, sample, eos_id, logits_out) -> Iterator[int]:
    if budget == 0:
        return
    device = model.model.embed_tokens.weight.device
    try:
        logits, kv = prefill(model, prompt_cpu, rows, prefill_chunk)
        for step in range(budget):
            token = sample_token(logits, **sample)
            if logits_out is not None:
                logits_out.append(logits.float().cpu())
            last = token == eos_id or step == budget - 1
            if not last:
                ids_cpu = torch.tensor([[token]])
                ids = ids_cpu.to(device)
                if rows is not None:
                    rows.request(ids, ids_cpu)  # before the yield: the rows travel while the caller prints
            yield token
            if last:
                return
            logits, kv = _forward(model, ids, kv, rows)
    finally:
        if rows is not None:
            rows.drain()  # a caller that stops early leaves a request behind; the next prompt must not meet it


def decode_step(model: StemLM, token: int, kv, rows: RowPipeline | None = None):
    """Feed one token after a prefill: request its rows, then run the forward. Returns (logits [V], KV cache)."""
    ids_cpu = torch.tensor([[int(token)]])
    ids = ids_cpu.to(model.model.embed_tokens.weight.device)
    if rows is not None:
        rows.request(ids, ids_cpu)
    return _forward(model, ids, kv, rows)


def forced_decode(
    model: StemLM,
    prompt: Sequence[int] | torch.Tensor,
    continuation: Sequence[int],
    *,
    rows: RowPipeline | None = None,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
) -> torch.Tensor:
    """Teacher-forced decoding: prefill `prompt`, then feed `continuation` one token per step (as if each had
    been sampled). Returns the [len(continuation) + 1, V] last-position logits of every forward, on the CPU;
    used to check offloaded logits against a full forward on a real id stream."""
    logits, kv = prefill(model, _prompt(model, prompt), rows, prefill_chunk)
    out = [logits]
    for token in continuation:
        logits, kv = decode_step(model, token, kv, rows)
        out.append(logits)
    return torch.stack(out).float().cpu()


# ----------------------------------------------------------------------------------------------------------
# one object for the CLI and scripts
# ----------------------------------------------------------------------------------------------------------
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
    ) -> None:
        """`provider` / `cache`: the token tables; `ngram_cache` / `memory_caches`: the other families (see
        `stemlm.offload.families`), whose providers `providers` lists."""
        self.model, self.provider, self.cache, self.prefill_chunk = model, provider, cache, prefill_chunk
        self.providers = providers or OffloadProviders(token=provider)
        self.ngram_cache, self.memory_caches = ngram_cache, memory_caches or {}
        token = RowPipeline(cache, background=background) if cache is not None else None
        if ngram_cache is None and not self.memory_caches:
            self.rows = token
        else:
            ngram = RowPipeline(ngram_cache, background=background) if ngram_cache is not None else None
            memory = MemoryFetcher(self.memory_caches) if self.memory_caches else None
            self.rows = LookupRows(model, token, ngram, memory)

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
        model, providers = load_offloaded_model(
            directory, tables, device=device, dtype=dtype, layout=layout, table_dtype=table_dtype
        )
        model.eval()
        caches: dict[str, RowCache | None] = {"token": None, "ngram": None}
        memory: dict[int, RowCache] = {}
        if table_placement(tables) != DEVICE:
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
        return cls(
            model,
            providers.token,
            caches["token"],
            background=background,
            prefill_chunk=prefill_chunk,
            ngram_cache=caches["ngram"],
            memory_caches=memory,
            providers=providers,
        )

    def stream(self, input_ids, max_new_tokens: int, **sampling) -> Iterator[int]:
        return stream_generate(
            self.model, input_ids, max_new_tokens, rows=self.rows, prefill_chunk=self.prefill_chunk, **sampling
        )

    def generate(self, input_ids, max_new_tokens: int, **sampling) -> list[int]:
        return list(self.stream(input_ids, max_new_tokens, **sampling))

    def stats(self) -> CacheStats | None:
        return None if self.cache is None else self.cache.stats

    def family_caches(self) -> dict[str, RowCache]:
        """Every row cache by family name: token, ngram, memory.<layer>."""
        named = {"token": self.cache, "ngram": self.ngram_cache}
        named.update({f"memory.{i}": c for i, c in self.memory_caches.items()})
        return {name: cache for name, cache in named.items() if cache is not None}

    def memory(self) -> dict[str, int | str]:
        """Where the bytes are: device parameters (tables excluded unless resident), tables, device cache."""
        providers = self.providers.all()
        kind = next(iter(providers.values())).kind if providers else "resident"
        table_bytes = sum(p.table_bytes for p in providers.values())
        caches = self.family_caches().values()
        return {
            "placement": kind,
            "device_parameter_bytes": device_parameter_bytes(self.model),
            "table_bytes": table_bytes,
            "host_table_bytes": table_bytes if kind == "host" else 0,
            "mapped_table_bytes": table_bytes if kind == "mmap" else 0,
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
            if isinstance(self.rows, LookupRows) and self.rows.memory is not None:
                out["memory_on_demand_wait_s"] = self.rows.memory.wait_seconds
        return out

    def summary(self) -> str:
        """Human-readable memory figures and cache statistics (one line each)."""
        m = self.memory()
        table_place = {"resident": "on the device", "host": "in host memory", "mmap": "memory-mapped"}[m["placement"]]
        lines = [
            f"memory: device parameters {m['device_parameter_bytes'] / 2**20:.2f} MiB, tables {table_place} "
            f"{m['table_bytes'] / 2**20:.2f} MiB, device cache {m['cache_rows']} rows "
            f"({m['cache_device_bytes'] / 2**20:.2f} MiB)"
        ]
        for name, cache in self.family_caches().items():
            label = "" if name == "token" else f"{name} rows: "
            lines.append(f"{label}{cache.policy.policy} {cache.stats.summary()}")
        if isinstance(self.rows, LookupRows) and self.rows.memory is not None:
            lines.append(
                f"memory rows fetched on demand (ids known only after each memory layer's top-k): "
                f"{self.rows.memory.wait_seconds:.3f} s on the critical path"
            )
        return "\n".join(lines)

    def close(self) -> None:
        if self.rows is not None:
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
