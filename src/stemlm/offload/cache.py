"""The hot-row device cache: a replacement policy (`CachePolicy`) and the device storage in front of a provider.

One cache serves all table layers at once. It is keyed by token id and each slot holds the token's
token-major row, the concatenation of that token's rows in every table layer (width |S|·d_ff for STEM),
because all table layers look up the same ids in the same forward: one decision and one transfer per token
instead of |S|. A capacity of N rows therefore means N tokens, N·|S|·d_ff values on the device.

A *step* is one forward (a prefill chunk or one decoding token). Per step:

1. The step's distinct ids are taken in order of first occurrence; each is one lookup of the cache (hits +
   misses = distinct ids; `lookups` counts token positions). Frequencies grow by the occurrence counts and
   every distinct id is touched in that order (a global clock gives each touch a unique stamp).
2. Hits are pinned for the step. Each miss, in first-occurrence order, takes a free slot or evicts the
   unpinned cached id that ranks lowest: LRU by stamp; LFU by (frequency, stamp), i.e. least frequently
   used with least-recent as the tie-break. Frequencies count every occurrence over the whole history,
   evicted or not, plus the warm-start counts ("perfect" LFU, which suits Zipfian token streams). An
   admitted miss is pinned too.
3. A miss that finds every slot pinned (capacity below the step's distinct ids, capacity 0 included) is
   *bypassed*: its row is served for this step from the staging buffer it was copied into and not cached.

`CachePolicy` is the bookkeeping alone (no rows), used by `stemlm cache-sim`; `RowCache` adds the device
storage and the copies. Warm start fills the cache with the most frequent ids of a corpus and seeds the LFU
counts with those frequencies. `replay` runs an id stream through a `CachePolicy`; `replay_grid` does so for
every (size, policy) pair `stemlm cache-sim` reports.
"""

from __future__ import annotations

import heapq
import math
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import torch

from stemlm.choices import CACHE_POLICIES
from stemlm.errors import StemlmError


def resolve_capacity(vocab_size: int, rows: int | None = None, fraction: float | None = None) -> int:
    """Cache capacity in rows (tokens) from a row count or a fraction of the vocabulary, clamped to the vocab."""
    if rows is not None and fraction is not None:
        raise StemlmError("give the cache size as rows or as a fraction of the vocabulary, not both")
    if fraction is not None:
        if not fraction >= 0:  # also rejects NaN
            raise StemlmError(f"cache fraction must be >= 0, got {fraction}")
        rows = math.floor(fraction * vocab_size + 1e-9)  # the epsilon keeps 0.2 * 8190 from flooring to 1637
    rows = 0 if rows is None else int(rows)
    if rows < 0:
        raise StemlmError(f"cache rows must be >= 0, got {rows}")
    if rows > vocab_size:
        warnings.warn(f"a cache of {rows} rows exceeds the vocabulary ({vocab_size}); clamped to it", stacklevel=2)
        rows = vocab_size
    return rows


@dataclass
class CacheStats:
    steps: int = 0
    lookups: int = 0  # token positions looked up
    unique_ids: int = 0  # distinct ids per step, summed over steps (= hits + misses)
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bypassed: int = 0  # misses served from the staging buffer without being cached
    bytes_h2d: int = 0  # table bytes copied host -> device (misses and the warm fill)
    wait_seconds: float = 0.0  # time the compute thread blocked waiting for rows

    @property
    def hit_rate(self) -> float:
        return self.hits / self.unique_ids if self.unique_ids else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate}

    def summary(self) -> str:
        return (
            f"cache: {self.hits}/{self.unique_ids} hits ({100 * self.hit_rate:.1f}%), {self.misses} misses, "
            f"{self.lookups} lookups in {self.steps} steps, {self.evictions} evictions, {self.bypassed} bypassed, "
            f"{self.bytes_h2d / 2**20:.2f} MiB host->device, {1000 * self.wait_seconds:.1f} ms waiting"
        )


@dataclass
class StepPlan:
    """What one step needs: distinct ids (first-occurrence order), where each lives, what to copy."""

    ids: list[int]  # distinct ids [U]
    inverse: list[int]  # token position -> index into ids [N]
    slots: list[int] = field(default_factory=list)  # cache slot per distinct id; -1 = bypassed (staging only)
    miss: list[bool] = field(default_factory=list)  # row must be read from the provider


@dataclass
class StepRows:
    """One step's rows on the device, as `RowCache.fetch` hands them to the model's table hook."""

    rows: torch.Tensor  # [U, width] token-major rows of the step's distinct ids, on the device
    inverse: torch.Tensor | None  # [N] position -> row index, on the device; None when it is the identity
    shape: tuple[int, ...]  # the ids' shape
    ready: object = None  # torch.cuda.Event recorded after the copies (None on CPU)
    plan: StepPlan | None = None


class CachePolicy:
    """Slot assignment and LFU / LRU replacement over token ids, without any row data."""

    def __init__(self, vocab_size: int, capacity: int, policy: str = "lfu", warm_counts=None) -> None:
        if policy not in CACHE_POLICIES:
            raise StemlmError(f"unknown cache policy {policy!r}; choose one of {', '.join(CACHE_POLICIES)}")
        if not 0 <= capacity <= vocab_size:
            raise StemlmError(f"cache capacity {capacity} must be in 0..{vocab_size} (see resolve_capacity)")
        self.vocab_size, self.capacity, self.policy = vocab_size, capacity, policy
        self.stats = CacheStats()
        self.freq = [0] * vocab_size
        self.stamp = [0] * vocab_size
        self.slot_of = [-1] * vocab_size
        self.token_of = [-1] * capacity  # slot -> cached id
        self.pinned_at = [-1] * vocab_size  # step number that pins the id
        self.free = list(range(capacity - 1, -1, -1))  # pop() hands out slot 0 first
        self.heap: list[tuple] = []  # lazy min-heap of (rank key..., id); stale entries are skipped
        self.clock = 0
        if warm_counts is not None:
            self.warm_ids = self._warm(warm_counts)
        else:
            self.warm_ids = []

    # ----- ranking -----
    def key(self, token: int) -> tuple:
        if self.policy == "lru":
            return (self.stamp[token], token)
        return (self.freq[token], self.stamp[token], token)

    def cached_ids(self) -> list[int]:
        return sorted(t for t in self.token_of if t >= 0)

    def _warm(self, counts) -> list[int]:
        counts = [int(c) for c in counts]
        if len(counts) != self.vocab_size:
            raise StemlmError(f"warm-start counts have {len(counts)} entries, the vocabulary has {self.vocab_size}")
        if min(counts, default=0) < 0:
            raise StemlmError("warm-start counts must be >= 0")
        self.freq = counts
        top = sorted((t for t in range(self.vocab_size) if counts[t] > 0), key=lambda t: (-counts[t], t))
        top = top[: self.capacity]
        for t in reversed(top):  # least frequent gets the oldest stamp, so LRU evicts it first too
            self._touch(t)
            self._admit(t, self.free.pop())
        return top

    def _touch(self, token: int) -> None:
        self.clock += 1
        self.stamp[token] = self.clock

    def _admit(self, token: int, slot: int) -> None:
        self.slot_of[token], self.token_of[slot] = slot, token
        heapq.heappush(self.heap, self.key(token))

    def _victim(self, step: int) -> int:
        """Free the slot of the lowest-ranked unpinned cached id; -1 when every cached id is pinned."""
        aside, slot = [], -1
        while self.heap:
            entry = heapq.heappop(self.heap)
            token = entry[-1]
            if self.slot_of[token] < 0 or entry != self.key(token):
                continue  # stale: evicted, or re-ranked by a later touch
            if self.pinned_at[token] == step:
                aside.append(entry)
                continue
            slot, self.slot_of[token] = self.slot_of[token], -1
            self.token_of[slot] = -1
            self.stats.evictions += 1
            break
        for entry in aside:
            heapq.heappush(self.heap, entry)
        return slot

    def _compact(self) -> None:
        cached = self.capacity - len(self.free)
        if len(self.heap) > 2 * cached + 64:
            self.heap = [self.key(t) for t in self.cached_ids()]
            heapq.heapify(self.heap)

    # ----- one step -----
    def plan(self, ids: list[int]) -> StepPlan:
        """Update the cache for one step's ids (flattened positions) and say where each distinct row lives."""
        first: dict[int, int] = {}
        inverse = [first.setdefault(t, len(first)) for t in ids]
        plan = StepPlan(ids=list(first), inverse=inverse)
        stats, step = self.stats, self.stats.steps
        stats.steps += 1
        stats.lookups += len(ids)
        stats.unique_ids += len(plan.ids)
        freq, slot_of = self.freq, self.slot_of
        for token in ids:
            freq[token] += 1
        for token in plan.ids:
            self._touch(token)
            self.pinned_at[token] = step
            if slot_of[token] >= 0:
                heapq.heappush(self.heap, self.key(token))  # re-ranked; the old entry goes stale
        for token in plan.ids:
            slot = slot_of[token]
            hit = slot >= 0
            if not hit and self.capacity:
                slot = self.free.pop() if self.free else self._victim(step)
                if slot >= 0:
                    self._admit(token, slot)
            plan.slots.append(slot)
            plan.miss.append(not hit)
        hits = plan.miss.count(False)
        stats.hits += hits
        stats.misses += len(plan.ids) - hits
        stats.bypassed += plan.slots.count(-1)
        self._compact()
        return plan


class RowCache:
    """Device storage of `capacity` token-major rows in front of a host provider (see the module docstring).

    `fetch` runs one step: plans it, reads the missing rows from the provider into (pinned) host memory,
    copies them to the device and assembles the step's rows. On CUDA every copy and every read or write of
    the storage is issued on the cache's own stream, in request order, so the next step's evictions can never
    overwrite rows an earlier step still has to read; `StepRows.ready` is the event to wait on.
    """

    def __init__(self, provider, capacity: int, policy: str = "lfu", device=None, warm_counts=None) -> None:
        self.provider = provider
        self.device = torch.device(device or "cpu")
        self.policy = CachePolicy(provider.vocab_size, capacity, policy, warm_counts)
        self.stats = self.policy.stats
        self.storage = torch.empty(capacity, provider.row_width, dtype=provider.dtype, device=self.device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if self.policy.warm_ids:
            slots = torch.tensor([self.policy.slot_of[t] for t in self.policy.warm_ids])
            rows = provider.gather(torch.tensor(self.policy.warm_ids))
            with self._on_stream():
                self.storage[slots.to(self.device)] = self._to_device(rows)
            if self.stream is not None:
                self.stream.synchronize()

    @property
    def capacity(self) -> int:
        return self.policy.capacity

    @property
    def device_bytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def _to_device(self, host_rows: torch.Tensor) -> torch.Tensor:
        self.stats.bytes_h2d += host_rows.numel() * host_rows.element_size()
        return host_rows.to(self.device, non_blocking=True)

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def fetch(self, ids: torch.Tensor) -> StepRows:
        """Rows for one step's ids (any shape, CPU): `StepRows` with [U, width] rows and the position map."""
        plan = self.policy.plan(ids.reshape(-1).tolist())
        # Staged row k (the k-th miss) either goes into a slot (admitted) or straight to its place in the
        # step's rows (bypassed); every other row is read from its slot.
        admit_src, admit_slot, bypass_src, bypass_pos, misses = [], [], [], [], []
        for i, (token, slot, miss) in enumerate(zip(plan.ids, plan.slots, plan.miss, strict=True)):
            if miss:
                (admit_src if slot >= 0 else bypass_src).append(len(misses))
                if slot >= 0:
                    admit_slot.append(slot)
                else:
                    bypass_pos.append(i)
                misses.append(token)
        all_staged = len(bypass_pos) == len(plan.ids)  # nothing served from the cache: staged rows are the rows
        identity = plan.inverse == list(range(len(plan.inverse)))  # distinct ids in order: no position map
        parts = [
            [] if all_staged else [max(slot, 0) for slot in plan.slots],
            admit_src,
            admit_slot,
            bypass_src,
            bypass_pos,
            [] if identity else plan.inverse,
        ]
        index = torch.tensor([x for part in parts for x in part], dtype=torch.long)  # one transfer for all
        staged_host = self.provider.gather(torch.tensor(misses, dtype=torch.long)) if misses else None
        if self.stream is not None:
            index = index.pin_memory()
        with self._on_stream():
            index = index.to(self.device, non_blocking=True)
            slots, a_src, a_slot, b_src, b_pos, inverse = index.split([len(part) for part in parts])
            staged = self._to_device(staged_host) if misses else None
            if admit_slot:
                self.storage.index_copy_(0, a_slot, staged.index_select(0, a_src))
            if all_staged:
                rows = staged
            else:
                rows = self.storage.index_select(0, slots)
                if bypass_pos:
                    rows.index_copy_(0, b_pos, staged.index_select(0, b_src))
            ready = None
            if self.stream is not None:
                ready = torch.cuda.Event()
                ready.record(self.stream)
        return StepRows(rows, None if identity else inverse, tuple(ids.shape), ready, plan)


def replay(
    stream: list[int], vocab_size: int, capacity: int, policy: str = "lfu", warm_counts=None, step_tokens: int = 1
) -> CacheStats:
    """Run an id stream through a cache, `step_tokens` ids per step (1 = decoding), and return its statistics."""
    if step_tokens < 1:
        raise StemlmError(f"step_tokens must be >= 1, got {step_tokens}")
    cache = CachePolicy(vocab_size, capacity, policy, warm_counts)
    for start in range(0, len(stream), step_tokens):
        cache.plan(stream[start : start + step_tokens])
    return cache.stats


def replay_grid(
    stream: list[int],
    rows: int,
    fractions,
    policies,
    counts: tuple[str, ...],
    warm_counts=None,
    step_tokens: int = 1,
    on_replay: Callable[[dict], None] | None = None,
) -> list[dict]:
    """`replay` at every cache size (a fraction of `rows`) and policy: one dict per (fraction, policy), in that
    order, with the `counts` fields of its `CacheStats` and the hit rate (what `stemlm cache-sim` reports).
    `on_replay(row)` is called after each replay (a progress bar's step)."""
    results = []
    for fraction in fractions:
        capacity = resolve_capacity(rows, fraction=fraction)
        for policy in policies:
            stats = replay(stream, rows, capacity, policy, warm_counts, step_tokens)
            row = {"policy": policy, "fraction": fraction, "capacity": capacity}
            results.append({**row, **{k: getattr(stats, k) for k in counts}, "hit_rate": stats.hit_rate})
            if on_replay is not None:
                on_replay(results[-1])
    return results
