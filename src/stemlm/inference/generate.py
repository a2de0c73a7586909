"""Autoregressive generation with the KV cache: one prefill, then one token per forward, streamed as sampled.

The pieces are separate so other code can reuse them: `top_k_filter` / `top_p_filter` / `sample_token` turn
one row of logits into a token id with torch ops and a seeded `torch.Generator`; `stream_tokens` is the
generator that yields each new token id the moment it is sampled (before the next forward runs), and
`generate` collects them into a list, calling an optional `on_token(token_id)` hook on the way; `TimedTokens`
times a stream as `stemlm generate` reports it, and `encode_prompt` turns a prompt text or typed ids into ids.

    from stemlm.inference.generate import generate
    new_ids = generate(model, [1, 2, 3], max_new_tokens=20, temperature=0.8, top_p=0.9, seed=0)

Table rows from outside the model (editing, offload) go in as `rows={family: provider}` (used by every
forward: the prefill sees the prompt ids [1, P], each decoding step the one new id [1, 1]); `prefill_rows`,
when given, replaces it for the prefill only, e.g. an edit that swaps rows at chosen prompt positions (its
`"embed"` entry supplies the input embeddings: `StemLM.forward`).
Generation stops at `eos_id` (which is included in the output), after `max_new_tokens`, or when prompt plus
output reach the model's `max_position_embeddings`. The prompt's ids are checked once, by the prefill; each
decoding step feeds back a sampled id (in range by construction) without the model's check, and reads its RoPE
row from the table the model keeps (`RotaryEmbedding.table`); a model loaded for inference
(`stemlm.inference.load`) also projects q/k/v, and gate/up, with one fused matrix each (`fuse_for_decoding`).
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from stemlm.errors import StemlmError
from stemlm.model.attention import KVCache
from stemlm.model.decoder import ForwardOptions, StemLM
from stemlm.model.ffn import Rows

CHECKED, UNCHECKED = ForwardOptions(), ForwardOptions(check_ids=False)  # the prefill checks the prompt ids, once

__all__ = [
    "IncrementalDecoder",
    "TimedTokens",
    "encode_prompt",
    "generate",
    "parse_ids",
    "sample_token",
    "stream_tokens",
    "top_k_filter",
    "top_p_filter",
]


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Set every logit below the k-th largest (per row, last dim) to -inf; ties with the k-th are kept."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose total probability is >= p.

    A token is dropped when the probability of the tokens ranked above it already reaches p, so the top
    token always survives. p >= 1 keeps everything (without rounding in the cumulative sum dropping a tail).
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.float().softmax(dim=-1)
    mass_above = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_above >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def check_sampling(temperature: float, top_k: int | None, top_p: float) -> None:
    if not math.isfinite(temperature) or temperature < 0:
        raise StemlmError(f"temperature must be a finite number >= 0 (0 means greedy), got {temperature}")
    if top_k is not None and top_k < 0:
        raise StemlmError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise StemlmError(f"top_p must be in (0, 1], got {top_p}")


def sample_token(
    logits: torch.Tensor,
    *,
    greedy: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> int:
    """One token id from a [V] (or [1, V]) row of logits: argmax when greedy or temperature == 0, otherwise
    temperature, then top-k, then top-p, then a draw from the renormalised distribution with `generator`."""
    logits = logits.reshape(-1).float()
    if greedy or temperature == 0:
        return int(torch.argmax(logits))
    logits = top_p_filter(top_k_filter(logits / temperature, top_k or 0), top_p)
    probs = logits.softmax(dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _as_prompt(model: StemLM, input_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    device = next(model.parameters()).device
    _check_id_values(input_ids)
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise StemlmError(f"generate takes one prompt (a list of ids, [T] or [1, T]), got shape {list(ids.shape)}")
    if ids.numel() == 0:
        raise StemlmError("the prompt is empty: generation needs at least one token to start from")
    limit = model.config.max_position_embeddings
    if ids.numel() >= limit:
        raise StemlmError(
            f"the prompt has {ids.numel()} tokens, which leaves no room to generate within the model's "
            f"max_position_embeddings={limit}; shorten it"
        )
    return ids[None]


def _check_id_values(input_ids: Sequence[int] | torch.Tensor) -> None:
    """Refuse ids that `torch.as_tensor(..., dtype=long)` would silently truncate (1.7 -> 1, True -> 1) or turn
    into a raw error (a ragged nested list): once per request, before decoding."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dtype == torch.bool or input_ids.dtype.is_floating_point or input_ids.dtype.is_complex:
            raise StemlmError(f"generate takes integer token ids, got a {input_ids.dtype} tensor")
        return
    if hasattr(input_ids, "dtype") and hasattr(input_ids, "shape"):  # a numpy array
        if input_ids.dtype.kind not in "iu":
            raise StemlmError(f"generate takes integer token ids, got a {input_ids.dtype} array")
        return
    if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Sequence):
        raise StemlmError(f"generate takes a list of token ids, got {type(input_ids).__name__}")
    row = input_ids[0] if len(input_ids) == 1 and isinstance(input_ids[0], (list, tuple)) else input_ids
    for i in row:
        if not isinstance(i, numbers.Integral) or isinstance(i, bool) or type(i).__name__ == "bool_":
            raise StemlmError(
                f"generate takes one prompt as a flat list of integer token ids; got an element {i!r:.40}"
            )


@torch.no_grad()
def _forward(model: StemLM, ids: torch.Tensor, cache, rows: Rows | None, check=True):
    # no_grad per call rather than around the generator: a context held across `yield` would leak into the caller.
    extra = {} if rows is None else {"rows": rows}
    out = model(ids, past_key_values=cache, use_cache=True, options=CHECKED if check else UNCHECKED, **extra)
    return out.logits[0, -1], out.past_key_values


def stream_tokens(
    model: StemLM,
    input_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    *,
    greedy: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
    rows: Rows | None = None,
    prefill_rows: Rows | None = None,
) -> Iterator[int]:
    """An iterator of new token ids; each is yielded before the forward that consumes it runs.

    Arguments are checked here, at the call, so a bad prompt fails before iteration starts.
    """
    check_sampling(temperature, top_k, top_p)
    if max_new_tokens < 0:
        raise StemlmError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    prompt = _as_prompt(model, input_ids)
    budget = min(max_new_tokens, model.config.max_position_embeddings - prompt.shape[1])
    generator = torch.Generator(device=prompt.device)
    generator.manual_seed(seed)
    sample = dict(greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    first = prefill_rows if prefill_rows is not None else rows
    return _decode(model, prompt, budget, sample, eos_id, first, rows)


def _decode(model, prompt, budget, sample, eos_id, prefill_rows, decode_rows) -> Iterator[int]:
    if budget == 0:
        return
    cache = KVCache(model.config.num_hidden_layers, capacity=prompt.shape[1] + budget)  # no regrowth while decoding
    logits, cache = _forward(model, prompt, cache, prefill_rows)  # the prompt's ids are checked here, once
    for step in range(budget):
        token = sample_token(logits, **sample)
        yield token
        if token == eos_id or step == budget - 1:
            return
        # A sampled id indexes the logits, so it is in range: the decoding steps skip the model's id check.
        logits, cache = _forward(model, torch.tensor([[token]], device=prompt.device), cache, decode_rows, False)


def generate(
    model: StemLM,
    input_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    *,
    on_token: Callable[[int], None] | None = None,
    **options: Any,
) -> list[int]:
    """The new token ids (eos included when hit); `on_token` is called with each one as soon as it is sampled.

    `options` are the keyword arguments of `stream_tokens` (sampling, seed, eos_id, table/embedding rows).
    """
    tokens = []
    for token in stream_tokens(model, input_ids, max_new_tokens, **options):
        tokens.append(token)
        if on_token is not None:
            on_token(token)
    return tokens


class IncrementalDecoder:
    """Turns a growing list of ids into printable text pieces that concatenate to the full decode.

    The whole list is decoded each time and only the new suffix is returned; a suffix ending in U+FFFD (a
    multi-byte character whose remaining bytes are still to come) is held back until it is complete.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.printed = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.printed):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """Everything not yet returned (held-back bytes print as U+FFFD if they never completed)."""
        text = self.tokenizer.decode(self.ids)
        return self._advance(text) if text.startswith(self.printed) else ""

    def _advance(self, text: str) -> str:
        piece, self.printed = text[len(self.printed) :], text
        return piece


def parse_ids(text: str, vocab_size: int) -> list[int]:
    """Token ids typed as "464,3139,286", each checked against the vocabulary."""
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise StemlmError(f"--ids {text!r} is not a comma-separated list of integers") from None
    if not ids:
        raise StemlmError("--ids is empty: pass at least one token id")
    for i in ids:
        if not 0 <= i < vocab_size:
            raise StemlmError(f"--ids: token id {i} is out of vocabulary (valid ids: 0..{vocab_size - 1})")
    return ids


def encode_prompt(tokenizer, vocab_size: int, text: str | None = None, ids: str | None = None) -> list[int]:
    """The prompt's ids from exactly one of a text (encoded with `tokenizer`) or typed ids (`parse_ids`)."""
    if (text is None) == (ids is None):
        raise StemlmError('pass exactly one of a prompt text or --ids (e.g. stemlm generate CKPT "Once upon")')
    if ids is not None:
        return parse_ids(ids, vocab_size)
    if tokenizer is None:
        raise StemlmError("this checkpoint has no tokenizer.json to encode the prompt; pass raw ids with --ids")
    encoded = tokenizer.encode(text).ids
    if not encoded:
        raise StemlmError("the prompt encodes to no tokens; pass some text")
    return encoded


class TimedTokens:
    """Iterates `tokens` (e.g. `stream_tokens(...)`), keeping the ids, the time to the first one and the total
    seconds (the consumer's time between tokens included, as a user waiting for them sees it)."""

    def __init__(self, tokens: Iterator[int]) -> None:
        self.tokens, self.ids, self.first, self.seconds = tokens, [], None, 0.0

    def __iter__(self) -> Iterator[int]:
        start = time.perf_counter()
        for token in self.tokens:
            if self.first is None:
                self.first = time.perf_counter() - start
            self.ids.append(token)
            yield token
        self.seconds = time.perf_counter() - start

    @property
    def rate(self) -> float:
        """Tokens per second."""
        return len(self.ids) / self.seconds if self.seconds > 0 else 0.0

    def report(self) -> dict:
        """The ids and timing as `stemlm generate --json` prints them."""
        return {
            "token_ids": self.ids,
            "num_new_tokens": len(self.ids),
            "seconds": self.seconds,
            "time_to_first_token_s": self.first,
            "tokens_per_s": self.rate,
        }
