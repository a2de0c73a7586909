"""The batch engine's KV pool: every active request's keys and values in one buffer per layer, on one time axis.

    pool = KVPool(slots=128, capacity=1024)
    pool.join(cache, P)                          # a prefilled request's cache becomes the last active row
    pool.join(shared, P, row=b)                  # or row b of prompts prefilled together, right-aligned
    cache, mask, positions = pool.step_inputs()  # what one decode forward over all active rows takes
    pool.advance()                               # after that forward: every row one position longer
    pool.leave(b)                                # row b's request finished; the last row moves into b

Layout. Per layer one [rows, kv_heads, length, head_dim] buffer; the active requests are its first rows (a request
that leaves is replaced by the last active row, so a forward reads a prefix view and gathers nothing). The rows
share one time axis of L positions: row b's n_b cached positions are right-aligned, L - n_b .. L - 1, so every
row writes its next position at L. A decode forward gets `attention_mask` (each row's valid positions; omitted
when no row is padded, as for one request alone) and `position_ids` (n_b): the left-padding support the model
has already, so no model code knows about batching.

The buffer grows on demand, doubling in rows (up to `slots`) and in positions (up to `capacity`), so a server
with many slots holds memory for the requests it runs, not for its limit; a join with a prompt longer than L
moves every row right (the axis grows on the left), and an axis longer than its longest row is trimmed.
Padding positions hold zeros (finite: a masked position gets exactly zero weight, and zero times a finite value
is zero). The n-gram and Engram kinds keep decoding state per position beside the cache (`KVCache.state`,
`stemlm.model.decoding_state`): a joining row's padding gets each entry's declared padding (ids -1, conv inputs
0), what a sequence start gives, so their keys and convolutions see exactly the single-stream context.
"""

from __future__ import annotations

import torch

from stemlm.model.attention import KVCache
from stemlm.model.decoding_state import DecodingState

MIN_POSITIONS = 64  # the first allocation's time axis (it doubles from there)


class KVPool:
    """Keys, values and decoding state of up to `slots` rows of up to `capacity` positions; see the module doc."""

    def __init__(self, slots: int, capacity: int) -> None:
        self.slots, self.capacity = slots, capacity
        self.keys: list[torch.Tensor] = []  # allocated at the first join (its dtype and device are the cache's)
        self.values: list[torch.Tensor] = []
        self.state = DecodingState()  # the lookup kinds' state of the active rows, [n, L, ...]
        self.counts: list[int] = []  # cached positions per active row
        self.length = 0  # L, the shared time axis

    @property
    def rows(self) -> int:
        return len(self.counts)

    @property
    def allocated(self) -> tuple[int, int]:
        """(rows, positions) the buffers hold now."""
        return (self.keys[0].shape[0], self.keys[0].shape[2]) if self.keys else (0, 0)

    def _reserve(self, rows: int, length: int, like: KVCache | None = None) -> None:
        """Room for `rows` rows of `length` positions, growing the buffers (doubling) when they are short."""
        have_rows, have_length = self.allocated
        if rows <= have_rows and length <= have_length:
            return
        new_rows = min(self.slots, max(rows, 2 * have_rows))
        new_length = min(self.capacity, max(length, 2 * have_length, MIN_POSITIONS))
        n, L = self.rows, self.length

        def grown(old: torch.Tensor | None, template: torch.Tensor) -> torch.Tensor:
            new = template.new_zeros((new_rows, template.shape[1], new_length, template.shape[3]))
            if old is not None and n:
                new[:n, :, :L] = old[:n, :, :L]
            return new

        if self.keys:
            self.keys = [grown(k, k) for k in self.keys]
            self.values = [grown(v, v) for v in self.values]
        else:
            self.keys = [grown(None, k) for k in like.keys]
            self.values = [grown(None, v) for v in like.values]

    def join(self, cache: KVCache, prompt_length: int, row: int = 0) -> None:
        """Append a prefilled request as the last active row: its `prompt_length` positions are the last ones that
        `cache` holds in row `row` (a prefill alone: row 0, all of it; prompts prefilled together: right-aligned)."""
        P, end = prompt_length, cache.length
        self._reserve(self.rows + 1, max(P, self.length), like=cache)
        self._realign(max([P, *self.counts]))
        b, L = self.rows, self.length
        for pool, new in zip(self.keys + self.values, cache.keys + cache.values, strict=True):
            pool[b, :, L - P : L] = new[row, :, end - P : end]
        joined = cache.state.map(
            lambda value, pad: torch.cat([_pad(value, 1, L - P, pad), value[row : row + 1, end - P : end]], dim=1)
        )
        self.state = self.state.stack(joined)
        self.counts.append(P)

    def leave(self, b: int) -> None:
        """Free row b: the last active row takes its place, so the active rows stay a prefix of the buffers."""
        last = self.rows - 1
        if b != last:
            for pool in self.keys + self.values:
                pool[b, :, : self.length] = pool[last, :, : self.length]
            self.counts[b] = self.counts[last]
        self.counts.pop()
        kept = [last if row == b else row for row in range(last)]
        self.state = self.state.map(lambda value, pad: value[kept])
        if not self.counts:
            self.length = 0

    def _realign(self, length: int) -> None:
        """Move every active row so that it ends at `length` (>= its count): grow or trim the axis on the left."""
        shift, n, L = length - self.length, self.rows, self.length
        if shift == 0:
            return
        self._reserve(n, length)
        for pool in self.keys + self.values:
            if shift > 0:
                pool[:n, :, shift : shift + L] = pool[:n, :, :L].clone()
            else:
                pool[:n, :, :length] = pool[:n, :, -shift:L].clone()
        if shift > 0:
            self.state = self.state.map(lambda value, pad: torch.cat([_pad(value, n, shift, pad), value], dim=1))
        else:
            self.state = self.state.map(lambda value, pad: value[:, -shift:])
        self.length = length

    def step_inputs(self) -> tuple[KVCache, torch.Tensor | None, torch.Tensor]:
        """The KV cache (views of the active rows), attention mask and [n, 1] positions of one decode forward."""
        if self.length + 1 > self.capacity:
            self._realign(max(self.counts))  # room for one more position: the trimmed axis always has it
        n, L = self.rows, self.length
        self._reserve(n, L + 1)
        device = self.keys[0].device
        counts = torch.tensor(self.counts, device=device)
        mask = None  # no row padded (one request, or equal lengths): the single-stream attention, no mask
        if any(c != L for c in self.counts):
            mask = torch.arange(L + 1, device=device)[None, :] >= (L - counts)[:, None]
        cache = KVCache(len(self.keys), capacity=self.capacity, state=self.state)  # the model extends the state
        cache.keys, cache.values = [k[:n] for k in self.keys], [v[:n] for v in self.values]
        cache.lengths = [L] * len(self.keys)
        return cache, mask, counts[:, None]

    def advance(self, cache: KVCache) -> None:
        """After the decode forward over `step_inputs`' cache: every row holds one more position."""
        self.state = cache.state
        self.length += 1
        self.counts = [c + 1 for c in self.counts]


def _pad(value: torch.Tensor, rows: int, length: int, pad: int) -> torch.Tensor:
    """`length` left-padding positions for `rows` rows of a decoding-state entry like `value`."""
    return value.new_full((rows, length, *value.shape[2:]), pad)
