"""Sampling: what a request may set (`SamplingParams`, checked in one place) and one token from a row of logits.

`top_k_filter` / `top_p_filter` / `sample_token` turn one row of logits into a token id with torch ops and a seeded
`torch.Generator` (argmax when greedy or at temperature 0; otherwise temperature, then top-k, then top-p, then a
draw). `SamplingParams` is every per-request setting of the decoding engine (`stemlm.inference.engine`): the
sampling controls, the most new tokens, the seed, stop strings and stop ids (eos), log-probabilities (of the
sampled tokens, and of the prompt's own tokens for scoring a text).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from stemlm.errors import StemlmError

MAX_LOGPROBS = 20  # OpenAI's limit for top logprobs per token


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


@dataclass(frozen=True)
class SamplingParams:
    """How one request decodes. `max_tokens` is bounded further by the context left after the prompt."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0  # the request's own generator is seeded with it: the same seed, the same sample
    greedy: bool = False  # argmax whatever the temperature
    stop: tuple[str, ...] = ()  # stop strings (need the engine's tokenizer); cut from the text
    stop_ids: tuple[int, ...] = ()  # token ids that end the request and are kept in its output (eos)
    logprobs: int | None = None  # None: no log-probabilities; k >= 0: the chosen token's and the top k
    prompt_logprobs: int | None = None  # the same for the prompt's own tokens, from the prefill's logits

    def check(self) -> None:
        """A one-line `StemlmError` for the first setting out of range."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise StemlmError(f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature}")
        if self.top_k < 0:
            raise StemlmError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise StemlmError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 0:
            raise StemlmError(f"max_new_tokens must be >= 0, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise StemlmError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise StemlmError(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}")
        if any(not s for s in self.stop):
            raise StemlmError("a stop string is empty")

    def sample(self, logits: torch.Tensor, generator: torch.Generator) -> int:
        """The next token from a [V] row of logits under these settings."""
        return sample_token(
            logits,
            greedy=self.greedy,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            generator=generator,
        )
