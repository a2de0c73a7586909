"""What the lookup kinds need from earlier positions, and the per-forward context they read it from.

n-gram keys (`stem_ngram`, `engram`) need the ids just before a forward's first position, and Engram's causal
conv needs the conv inputs of the positions before it. With a KV cache those positions were computed by an
earlier call, so the cache carries a `DecodingState` beside its keys and values (`KVCache.state`): `ids` [B, L]
(the input ids of every cached position, -1 at left padding) and `conv` {layer: [B, L, d]} (Engram's conv
inputs, 0 at left padding). Every position is kept (like keys and values), and readers slice it to the cache's
current length, so a cropped cache stays consistent. Each field declares its padding value (`PAD`), so code that
moves rows between caches (the batch engine's KV pool) pads, trims and gathers the state without knowing the
kinds. A Hugging Face cache is transformers' class, which cannot declare a field: there the state rides on the
cache object as the attribute `FOREIGN_ATTR` (our `_HFCacheView` is rebuilt every call, the HF cache persists).
Beam search reorders the cache's rows between steps; `reorder_decoding_state` reorders the state's rows with
them (`StemlmForCausalLM._reorder_cache`), so every entry keeps the batch on dim 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from stemlm.errors import StemlmError
from stemlm.model.ffn import TokenContext
from stemlm.model.ngram import NgramHasher

FOREIGN_ATTR = "_stemlm_decoding_state"  # the state on a cache class we do not own (transformers')
CONV_KEY = "engram_conv."  # how the Engram kind names its layer's entry: "engram_conv.<layer>"


@dataclass
class DecodingState:
    """Per-position state of the cached positions, batch on dim 0 and positions on dim 1."""

    ids: torch.Tensor | None = None  # [B, L] input ids; None until a forward of an n-gram kind wrote them
    conv: dict[int, torch.Tensor] = field(default_factory=dict)  # Engram layer -> [B, L, d] conv inputs

    PAD = {"ids": -1, "conv": 0}  # what a left-padded position holds: no id, and the conv's zero input

    # The Engram kind reads and writes its layer's entry by name (`ctx.state.get(key)`, `ctx.state[key] = x`).
    def get(self, key: str) -> torch.Tensor | None:
        return self.conv.get(_conv_layer(key))

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.conv[_conv_layer(key)] = value

    def __bool__(self) -> bool:
        return self.ids is not None or bool(self.conv)

    def map(self, fn: Callable[[torch.Tensor, int], torch.Tensor]) -> DecodingState:
        """A new state whose every entry is `fn(entry, its padding value)`."""
        ids = None if self.ids is None else fn(self.ids, self.PAD["ids"])
        return DecodingState(ids, {i: fn(t, self.PAD["conv"]) for i, t in self.conv.items()})

    def stack(self, other: DecodingState) -> DecodingState:
        """The rows of `self` followed by the rows of `other` (the same entries, the same length)."""
        if not self:
            return other
        ids = None if self.ids is None else torch.cat([self.ids, other.ids])
        return DecodingState(ids, {i: torch.cat([t, other.conv[i]]) for i, t in self.conv.items()})


def _conv_layer(key: str) -> int:
    if not key.startswith(CONV_KEY):
        raise KeyError(f"{key!r} is no decoding-state entry (entries: ids, {CONV_KEY}<layer>)")
    return int(key.removeprefix(CONV_KEY))


def decoding_state(cache) -> DecodingState | None:
    """The decoding state of a cache: our `KVCache`'s own field, or the one riding on a Hugging Face cache
    (created empty on first use); None without a cache."""
    if cache is None:
        return None
    if isinstance(getattr(cache, "state", None), DecodingState):
        return cache.state
    owner = getattr(cache, "cache", cache)  # an _HFCacheView: keep the state on the HF cache, which persists
    state = getattr(owner, FOREIGN_ATTR, None)
    if state is None:
        state = DecodingState()
        setattr(owner, FOREIGN_ATTR, state)
    return state


def reorder_decoding_state(cache, index: torch.Tensor) -> None:
    """Take the decoding state's rows in `index` order (beam search's reordering of the cache's batch rows)."""
    state = decoding_state(cache)
    new = state.map(lambda rows, pad: rows.index_select(0, index.to(rows.device)))
    state.ids, state.conv = new.ids, new.conv


def fill_lookup_context(
    ctx: TokenContext,
    hasher: NgramHasher | None,
    attention_mask: torch.Tensor | None,
    cache,
    past_len: int,
) -> None:
    """Set the context's decoding state, padding mask and (n-gram kinds) the n-gram row ids of this forward."""
    ctx.state, ctx.past_len = decoding_state(cache), past_len
    if attention_mask is not None:
        ctx.valid = attention_mask[:, past_len:].bool()
    if hasher is None:
        return
    ids = ctx.input_ids if ctx.valid is None else ctx.input_ids.masked_fill(~ctx.valid, -1)
    prev = ids.new_full((ids.shape[0], hasher.context), -1)
    if past_len:
        seen = None if ctx.state is None else ctx.state.ids
        if seen is None or seen.shape[1] < past_len:
            raise StemlmError(
                "this cache holds positions computed without their token ids (n-gram kinds need them): "
                "build the cache with this model's own forward"
            )
        take = min(hasher.context, past_len)
        prev[:, hasher.context - take :] = seen[:, past_len - take : past_len]
    ctx.ngram_ids = hasher.ids(ids, prev)
    if ctx.state is not None:
        ctx.state.ids = ids if not past_len else torch.cat([ctx.state.ids[:, :past_len], ids], dim=1)
