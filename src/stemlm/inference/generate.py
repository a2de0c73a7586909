"""Autoregressive generation with the KV cache, as functions: `stream_tokens` and `generate` over the engine.

    from stemlm.inference.generate import generate
    new_ids = generate(model, [1, 2, 3], max_new_tokens=20, temperature=0.8, top_p=0.9, seed=0)

`stream_tokens` is the generator that yields each new token id the moment it is sampled (before the next forward
runs); `generate` collects them into a list, calling an optional `on_token(token_id)` hook on the way. Both are
the decoding engine (`stemlm.inference.engine.Engine`) with one `Request`: `model` is a `StemLM` or an
`InferenceModel` (a loaded model: its autocast, offloaded rows and compiled steps). Table rows from outside the
model go in as `rows={family: provider}` (every forward); `prefill_rows` go over them for the prefill only, e.g.
an edit that swaps rows at chosen prompt positions (its `"embed"` entry supplies the input embeddings:
`StemLM.forward`). Generation stops at `eos_id` (which is included in the output), after `max_new_tokens`, or
when prompt plus output reach the model's `max_position_embeddings`.
`TimedTokens` times a stream as `stemlm generate` reports it, and `encode_prompt` turns a prompt text or typed
ids into ids.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from stemlm.errors import StemlmError
from stemlm.inference.engine import Engine
from stemlm.inference.inference_model import InferenceModel
from stemlm.inference.requests import Request
from stemlm.inference.sampling import SamplingParams
from stemlm.model.decoder import StemLM
from stemlm.model.ffn import Rows

__all__ = ["TimedTokens", "encode_prompt", "generate", "generation_request", "parse_ids", "stream_tokens"]


def generation_request(
    input_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    *,
    greedy: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
    prefill_rows: Rows | None = None,
) -> Request:
    """The engine `Request` of `stream_tokens`' keywords (checked now: a bad prompt or setting raises here)."""
    params = SamplingParams(
        max_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k or 0,
        seed=seed,
        greedy=greedy,
        stop_ids=() if eos_id is None else (eos_id,),
    )
    return Request(input_ids, params, edit_rows=prefill_rows)


def stream_tokens(
    model: StemLM | InferenceModel,
    input_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    *,
    rows: Rows | None = None,
    **options: Any,
) -> Iterator[int]:
    """An iterator of new token ids; each is yielded before the forward that consumes it runs. `options`: the
    keywords of `generation_request` (sampling, seed, eos_id, prefill_rows).

    Arguments are checked here, at the call, so a bad prompt fails before iteration starts.
    """
    return Engine(model, rows=rows).stream(generation_request(input_ids, max_new_tokens, **options))


def generate(
    model: StemLM | InferenceModel,
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
