"""One request of the batched decode engine: its sampling settings, its output so far, and its text with stops.

`SamplingParams` holds what an OpenAI request may set per request (max_tokens, temperature, top_p, top_k, seed,
stop strings, logprobs); `Request` is one prompt in the engine (`stemlm.inference.batching`) with its own seeded
generator, so a request samples exactly what `stemlm.inference.generate` samples for the same prompt and seed.
Every new token is handed to the request's `on_event` callback as a `TokenEvent` (id, printable text piece,
log-probabilities when asked), and the request ends with a finish reason:

    "length"     max_tokens (or the context) reached        "stop"       eos id or a stop string
    "cancelled"  `BatchEngine.cancel` (client gone, timeout) "error"      the forward raised (message in `error`)

`StopText` turns text pieces into output text that never contains a stop string: a piece that might be the
start of one is held back until it is known not to be.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from stemlm.errors import StemlmError
from stemlm.inference.generate import IncrementalDecoder, check_sampling, sample_token

MAX_LOGPROBS = 20  # OpenAI's limit for top logprobs per token
FINISH_REASONS = ("length", "stop", "cancelled", "error")
_ids = itertools.count()


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    stop: tuple[str, ...] = ()  # stop strings (need the engine's tokenizer)
    stop_ids: tuple[int, ...] = ()  # token ids that end the request and are kept in its output (eos)
    logprobs: int | None = None  # None: no log-probabilities; k >= 0: the chosen token's and the top k

    def check(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p)
        if self.max_tokens < 1:
            raise StemlmError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise StemlmError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if any(not s for s in self.stop):
            raise StemlmError("a stop string is empty")


@dataclass
class TokenEvent:
    token_id: int
    text: str  # the printable text this token adds (may be "" while a character or a stop string is pending)
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, log-probability), most likely first


class StopText:
    """Output text with stop strings cut: `feed(piece) -> (text to emit, stopped)`; `flush()` at the end."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.text = ""
        self.sent = 0  # characters of `text` already emitted

    def feed(self, piece: str) -> tuple[str, bool]:
        self.text += piece
        found = [i for i in (self.text.find(s, max(0, self.sent - len(s) + 1)) for s in self.stops) if i >= 0]
        if found:
            cut = min(found)
            out, self.sent = self.text[self.sent : cut], cut
            self.text = self.text[:cut]
            return out, True
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        safe = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent : safe], safe
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


@dataclass
class Request:
    """A prompt in the engine. `prefill_hooks`: row hooks for its prefill forward only (a positional edit),
    the keyword arguments of `StemLM.forward`; decode steps read the edited prompt from the KV cache."""

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    on_event: Callable[[Request, TokenEvent | None], None] | None = None  # None event: the request finished
    prefill_hooks: dict = field(default_factory=dict)
    id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        self.params.check()
        if not self.prompt_ids:
            raise StemlmError("the prompt is empty: generation needs at least one token to start from")
        self.done = threading.Event()
        self.cancelled = False
        self.budget = self.params.max_tokens
        self.generator: torch.Generator | None = None
        self._decoder: IncrementalDecoder | None = None
        self._stop: StopText | None = None

    def start(self, device: torch.device, tokenizer, context: int) -> None:
        """Called by the engine at admission: the seeded generator, the budget within `context` positions."""
        if len(self.prompt_ids) >= context:
            raise StemlmError(
                f"the prompt has {len(self.prompt_ids)} tokens, which leaves no room to generate within the "
                f"context of {context}; shorten it"
            )
        self.budget = min(self.params.max_tokens, context - len(self.prompt_ids))
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(self.params.seed)
        if tokenizer is not None:
            self._decoder = IncrementalDecoder(tokenizer)
            self._stop = StopText(self.params.stop)
        elif self.params.stop:
            raise StemlmError("stop strings need a tokenizer; this engine has none")

    def sample(self, logits: torch.Tensor) -> bool:
        """Sample the next token from a [V] row of logits and emit it; True when the request is finished."""
        p = self.params
        token = sample_token(
            logits, temperature=p.temperature, top_k=p.top_k or None, top_p=p.top_p, generator=self.generator
        )
        event = TokenEvent(token, "")
        if p.logprobs is not None:
            logp = logits.float().log_softmax(-1)
            event.logprob = float(logp[token])
            if p.logprobs:
                top = torch.topk(logp, min(p.logprobs, logp.numel()))
                event.top_logprobs = [(int(i), _finite(v)) for v, i in zip(top.values, top.indices, strict=True)]
        self.output_ids.append(token)
        stopped = token in p.stop_ids
        if self._decoder is not None:
            piece, hit = self._stop.feed(self._decoder.push(token))
            if stopped:
                piece += self._stop.feed(self._decoder.flush())[0] + self._stop.flush()
            event.text, self.text = piece, self.text + piece
            stopped = stopped or hit
        self._emit(event)
        if stopped:
            self.finish("stop")
        elif len(self.output_ids) >= self.budget:
            if self._decoder is not None:
                rest = self._stop.feed(self._decoder.flush())[0] + self._stop.flush()
                if rest:
                    self.text += rest
                    self._emit(TokenEvent(-1, rest))  # id -1: text only (a held-back tail), no new token
            self.finish("length")
        return self.finish_reason is not None

    def finish(self, reason: str, error: str | None = None) -> None:
        if self.finish_reason is not None:
            return
        self.finish_reason, self.error = reason, error
        self.done.set()
        self._emit(None)

    def _emit(self, event: TokenEvent | None) -> None:
        if self.on_event is not None:
            self.on_event(self, event)


def _finite(value: torch.Tensor) -> float:
    # -inf log-probabilities (a logit of -inf) are not valid JSON; OpenAI clients accept a very low number.
    v = float(value)
    return v if math.isfinite(v) else -9999.0
