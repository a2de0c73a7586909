"""What the lookup kinds need from earlier positions, and the per-forward context they read it from.

n-gram keys (`stem_ngram`, `engram`) need the ids just before a forward's first position, and Engram's causal
conv needs the conv inputs of the positions before it. With a KV cache those positions were computed by an
earlier call, so the cache carries a small dict beside its keys and values: `ids` [B, L] (the input ids of every
cached position, -1 at left padding) and `engram_conv.<layer>` [B, L, d]. Every position is kept (like keys and
values), and readers slice it to the cache's current length, so a cropped cache stays consistent. For a
Hugging Face cache the dict lives on the HF cache object itself (our `_HFCacheView` is rebuilt every call).
Beam search reorders the cache's rows between steps; `reorder_decoding_state` reorders this dict's rows with
them (`StemlmForCausalLM._reorder_cache`), so every entry keeps the batch on dim 0.
"""

from __future__ import annotations

import torch

from stemlm.errors import StemlmError
from stemlm.model.ffn import TokenContext
from stemlm.model.ngram import NgramHasher

STATE_ATTR = "_stemlm_decoding_state"


def decoding_state(cache) -> dict | None:
    """The decoding-state dict of a cache (created empty on first use); None without a cache."""
    if cache is None:
        return None
    owner = getattr(cache, "cache", cache)  # an _HFCacheView: keep the state on the HF cache, which persists
    state = getattr(owner, STATE_ATTR, None)
    if state is None:
        state = {}
        setattr(owner, STATE_ATTR, state)
    return state


def reorder_decoding_state(cache, index: torch.Tensor) -> None:
    """Take the decoding state's rows in `index` order (beam search's reordering of the cache's batch rows)."""
    state = getattr(getattr(cache, "cache", cache), STATE_ATTR, None) or {}
    for name, rows in state.items():
        state[name] = rows.index_select(0, index.to(rows.device))


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
        seen = None if ctx.state is None else ctx.state.get("ids")
        if seen is None or seen.shape[1] < past_len:
            raise StemlmError(
                "this cache holds positions computed without their token ids (n-gram kinds need them): "
                "build the cache with this model's own forward"
            )
        take = min(hasher.context, past_len)
        prev[:, hasher.context - take :] = seen[:, past_len - take : past_len]
    ctx.ngram_ids = hasher.ids(ids, prev)
    if ctx.state is not None:
        ctx.state["ids"] = ids if not past_len else torch.cat([ctx.state["ids"][:, :past_len], ids], dim=1)
