"""One request of the decoding engine: its prompt, sampling settings, output so far, and its text with stops.

`Request` is one prompt in the engine (`stemlm.inference.engine`, single-stream or batched), the one place where
a prompt is checked (one flat list of integer ids, not empty, shorter than the context), the budget is set (its
`max_tokens` within the context left), its own generator is seeded (so a request samples the same tokens alone or
in a batch) and each sampled token is checked against the stop conditions. Every new token is handed to the
request's `on_event` callback as a `TokenEvent` (id, printable text piece, log-probabilities when asked), and the
request ends with a finish reason:

    "length"     max_tokens (or the context) reached        "stop"       a stop id (eos) or a stop string
    "cancelled"  `BatchEngine.cancel` (client gone, timeout) "error"      the forward raised (message in `error`)

With `prompt_logprobs` set, the prefill's logits (every prompt position's, which the forward computes anyway)
also score the prompt itself (`score_prompt`): `prompt_logprobs` holds a `TokenEvent` per prompt token, the first
without a log-probability (nothing precedes it); `max_tokens=0` then scores the prompt without generating.

A request's `edit_rows` (a positional edit's `rows=` mapping, `stemlm.edit.positional.edit_hooks`) apply to its
prefill only: the edited keys and values then sit in its KV cache and no other request sees them.
`IncrementalDecoder` turns ids into printable text pieces; `StopText` turns text pieces into output text that
never contains a stop string: a piece that might be the start of one is held back until it is known not to be.
"""

from __future__ import annotations

import itertools
import math
import numbers
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from stemlm.errors import StemlmError
from stemlm.inference.sampling import SamplingParams
from stemlm.model.ffn import Rows

FINISH_REASONS = ("length", "stop", "cancelled", "error")
_ids = itertools.count()


def new_group() -> int:
    """A fresh `Request.group` for the sequences of one client request (never the id of another request)."""
    return next(_ids)


def prompt_list(input_ids) -> list[int]:
    """One prompt as a list of ids, from a list / tuple (or one nested in a list), a [T] or [1, T] tensor or numpy
    array. Refuses what `torch.as_tensor(..., dtype=long)` would silently truncate (1.7 -> 1, True -> 1) or turn
    into a raw error (a ragged nested list), and an empty prompt."""
    if isinstance(input_ids, torch.Tensor) or (hasattr(input_ids, "dtype") and hasattr(input_ids, "shape")):
        if isinstance(input_ids, torch.Tensor):
            if input_ids.dtype == torch.bool or input_ids.dtype.is_floating_point or input_ids.dtype.is_complex:
                raise StemlmError(f"generate takes integer token ids, got a {input_ids.dtype} tensor")
        elif input_ids.dtype.kind not in "iu":  # a numpy array
            raise StemlmError(f"generate takes integer token ids, got a {input_ids.dtype} array")
        shape = list(input_ids.shape)
        if len(shape) == 2 and shape[0] == 1:
            input_ids = input_ids[0]
        elif len(shape) != 1:
            raise StemlmError(f"generate takes one prompt (a list of ids, [T] or [1, T]), got shape {shape}")
        ids = [int(i) for i in input_ids.tolist()]
    else:
        if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Sequence):
            raise StemlmError(f"generate takes a list of token ids, got {type(input_ids).__name__}")
        row = input_ids[0] if len(input_ids) == 1 and isinstance(input_ids[0], (list, tuple)) else input_ids
        for i in row:
            if not isinstance(i, numbers.Integral) or isinstance(i, bool) or type(i).__name__ == "bool_":
                raise StemlmError(
                    f"generate takes one prompt as a flat list of integer token ids; got an element {i!r:.40}"
                )
        ids = [int(i) for i in row]
    if not ids:
        raise StemlmError("the prompt is empty: generation needs at least one token to start from")
    return ids


@dataclass
class TokenEvent:
    token_id: int
    text: str  # the printable text this token adds (may be "" while a character or a stop string is pending)
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, log-probability), most likely first


class IncrementalDecoder:
    """Turns a growing list of ids into printable text pieces that concatenate to the full decode.

    Each push decodes a short window, not the whole list: the ids from `prefix` (where the last emitted piece's
    context starts) to the end, against the same window without the new ids; the difference is the new text. A
    window starting one piece back gives a tokenizer whose decoding depends on the previous token (a word-start
    marker, a byte sequence) the context it needs, and keeps a token's cost independent of the length so far. A
    difference ending in U+FFFD (a multi-byte character whose remaining bytes are still to come) is held back
    until it is complete.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = self.read = 0  # window start; ids before `read` are emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Everything not yet returned (held-back bytes print as U+FFFD if they never completed)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        if len(text) <= len(before) or not text.startswith(before) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before) :]


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
    """A prompt in the engine; see the module docstring. `prompt_ids` may be any form `prompt_list` takes."""

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    on_event: Callable[[Request, TokenEvent | None], None] | None = None  # None event: the request finished
    edit_rows: Rows | None = None  # rows for its prefill only (a positional edit)
    group: int | None = None  # requests of one group are admitted fairly against other groups (None: its own)
    id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        self.params.check()
        self.prompt_ids = prompt_list(self.prompt_ids)
        self.done = threading.Event()
        self.cancelled = False
        self.prompt_logprobs: list[TokenEvent] | None = None  # `score_prompt`'s, when the params ask for them
        self.budget = self.params.max_tokens
        # perf_counter times for queue wait and time to first token (set by the batch engine and `sample`)
        self.submitted_at = self.admitted_at = self.first_token_at = None
        self.rank = 0  # its group's sequences in the engine when it was submitted (admission order)
        self.generator: torch.Generator | None = None
        self._decoder: IncrementalDecoder | None = None
        self._stop: StopText | None = None

    def start(self, device: torch.device, tokenizer, context: int, what: str = "") -> None:
        """Called by the engine before the prefill: the budget within `context` positions (`what`: their name in
        an error), the seeded generator."""
        if len(self.prompt_ids) >= context:
            raise StemlmError(
                f"the prompt has {len(self.prompt_ids)} tokens, which leaves no room to generate within "
                f"{what or f'the context of {context}'}; shorten it"
            )
        self.budget = min(self.params.max_tokens, context - len(self.prompt_ids))
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(self.params.seed)
        if tokenizer is not None:
            self._decoder = IncrementalDecoder(tokenizer)
            self._stop = StopText(self.params.stop)
        elif self.params.stop:
            raise StemlmError("stop strings need a tokenizer; this engine has none")

    @property
    def group_key(self) -> int:
        return self.id if self.group is None else self.group

    def history(self) -> list[int]:
        """The ids before the last sampled one: what the forward that feeds it back continues."""
        return self.prompt_ids + self.output_ids[:-1]

    def sample(self, logits: torch.Tensor, token: int | None = None) -> bool:
        """Sample the next token from a [V] row of logits (or take `token`, a greedy row's argmax taken over the
        whole batch at once) and emit it; True when the request is finished."""
        p = self.params
        token = p.sample(logits, self.generator) if token is None else token
        if not self.output_ids:
            self.first_token_at = time.perf_counter()
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

    def score_prompt(self, logits: torch.Tensor, start: int) -> None:
        """Record the prompt's log-probabilities from one prefill forward's [n, V] logits of prompt positions
        `start`..`start + n - 1` (position p predicts prompt token p + 1); called for each prefill chunk in order."""
        k = self.params.prompt_logprobs
        if start == 0:
            self.prompt_logprobs = [TokenEvent(self.prompt_ids[0], "")]
        targets = self.prompt_ids[start + 1 : start + 1 + logits.shape[0]]
        if not targets:
            return  # the last position predicts what comes after the prompt: that is sampling's
        logp = logits[: len(targets)].float().log_softmax(-1)
        chosen = logp.gather(-1, torch.tensor(targets, device=logp.device)[:, None])[:, 0]
        top = torch.topk(logp, min(k, logp.shape[-1])) if k else None
        for row, token in enumerate(targets):
            event = TokenEvent(token, "", _finite(chosen[row]))
            if top is not None:
                pairs = zip(top.values[row], top.indices[row], strict=True)
                event.top_logprobs = [(int(i), _finite(v)) for v, i in pairs]
            self.prompt_logprobs.append(event)

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
