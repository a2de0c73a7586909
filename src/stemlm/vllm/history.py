"""Earlier positions of each request in vLLM's flattened step, for the kinds that read them (stem_ngram, engram).

vLLM hands a model the tokens of one step (prompt chunks and one decode token per running request, flattened into
one batch) and their positions. A hashed n-gram id at position p needs the ids at p-1 .. p-n+1, and Engram's causal
convolution the conv inputs of up to (kernel - 1) · dilation earlier positions; for a decode token they were
computed in earlier steps. As vLLM's own Engram model keeps its hash history (the V1 "slot cache" of
vllm/models/deepseek_v41/common/engram.py), they are kept per KV-cache slot: a position's slot is fixed by its
request's block table for as long as its keys and values are kept, a prefix-cache hit reuses blocks whose tokens
(and so whose values) are the same, and a recomputed (preempted) request writes its slots again. A step writes its
tokens' entries at their slots (the attention metadata's `slot_mapping`) and reads position p-j of request r from
the step itself when p-j lies in the same chunk, else at block_table[r, (p-j) // block_size] · block_size +
(p-j) % block_size. Positions before a sequence's start read as absent (the n-gram "no token", a zero conv input),
as in stemlm's own forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Lookback:
    """Where position p-j of each token's request is, for j = 1 .. depth: `local` [N, depth] its index among this
    step's tokens (-1: not in the step), `slots` [N, depth] its KV slot when it lies before the step (-1: not there,
    or before the start), `write` [N] each token's own slot (-1: a padding token, nothing kept)."""

    local: torch.Tensor
    slots: torch.Tensor
    write: torch.Tensor

    def gather(self, current: torch.Tensor, store: SlotStore) -> torch.Tensor:
        """[N, depth, *row] the rows of positions p-1 .. p-depth: from `current` [N, *row] (this step's rows) or
        from `store` (earlier steps'), the store's `absent` value where neither has one."""
        rows = store.read(self.slots)
        local = current[self.local.clamp_min(0)]
        inside = (self.local >= 0).view(*self.local.shape, *[1] * (current.dim() - 1))
        return torch.where(inside, local.to(rows.dtype), rows)


class SlotStore:
    """One row per KV slot, [slots, *row]: grown on first write past its end (slots are bounded by the KV cache's
    blocks), read as `absent` where nothing was written."""

    def __init__(self, row: tuple[int, ...], dtype: torch.dtype, absent: float | int) -> None:
        self.row, self.dtype, self.absent = row, dtype, absent
        self.rows: torch.Tensor | None = None

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        out = torch.full((*slots.shape, *self.row), self.absent, dtype=self.dtype, device=slots.device)
        if self.rows is None:
            return out
        there = (slots >= 0) & (slots < self.rows.shape[0])
        out[there] = self.rows[slots[there]]
        return out

    def write(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        keep = slots >= 0
        if not bool(keep.any()):
            return
        slots, values = slots[keep], values[keep]
        needed = int(slots.max()) + 1
        if self.rows is None or self.rows.shape[0] < needed:
            grown = torch.full((max(needed, 2 * (0 if self.rows is None else self.rows.shape[0])), *self.row),
                               self.absent, dtype=self.dtype, device=values.device)  # fmt: skip
            if self.rows is not None:
                grown[: self.rows.shape[0]] = self.rows
            self.rows = grown
        self.rows[slots] = values.to(self.dtype)


def no_history(tokens: int, depth: int, device: torch.device) -> Lookback:
    """A step without attention metadata (vLLM's profiling and dummy runs): no position has earlier ones."""
    none = torch.full((tokens, depth), -1, dtype=torch.long, device=device)
    return Lookback(none, none, torch.full((tokens,), -1, dtype=torch.long, device=device))


def lookback(metadata, positions: torch.Tensor, depth: int, block_size: int) -> Lookback:
    """The `Lookback` of a step from its attention metadata (`query_start_loc`, `block_table`, `slot_mapping`,
    `num_actual_tokens`: the fields every vLLM attention backend's metadata carries) and the tokens' positions."""
    if metadata is None:
        return no_history(positions.shape[0], depth, positions.device)
    tokens, real = positions.shape[0], metadata.num_actual_tokens
    starts = metadata.query_start_loc.long()
    index = torch.arange(real, device=positions.device)
    request = torch.searchsorted(starts[1:], index, right=True)  # the request each token belongs to
    pos = positions[:real].long()
    table = metadata.block_table.long()
    own = table[request, pos // block_size] * block_size + pos % block_size
    write = metadata.slot_mapping[:real].long()
    if not torch.equal(own[write >= 0], write[write >= 0]):
        raise RuntimeError(
            f"stemlm's vLLM plugin: the attention metadata's block table does not address its slots with blocks of "
            f"{block_size}; the n-gram kinds cannot find earlier positions on this attention backend"
        )
    j = torch.arange(1, depth + 1, device=positions.device)
    earlier, back = pos[:, None] - j, index[:, None] - j  # position p-j, and where it would be in this step
    in_step = (back >= starts[request][:, None]) & (earlier >= 0)
    before = (back < starts[request][:, None]) & (earlier >= 0)
    safe = earlier.clamp_min(0)
    slots = table[request[:, None], safe // block_size] * block_size + safe % block_size
    local = torch.where(in_step, back, -1)
    slots = torch.where(before, slots, -1)
    pad = tokens - real  # vLLM pads a step's tokens (CUDA graph sizes): the padding has no history
    if pad:
        none = torch.full((pad, depth), -1, dtype=torch.long, device=positions.device)
        local, slots = torch.cat([local, none]), torch.cat([slots, none])
        write = torch.cat([write, torch.full((pad,), -1, dtype=torch.long, device=positions.device)])
    return Lookback(local, slots, write)
