"""The decoding engine: one prefill, one decoding step and one decoding loop for every caller.

    engine = Engine(model)                                    # a StemLM, or an InferenceModel (autocast, rows)
    request = Request([1, 2, 3], SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=0))
    for token in engine.stream(request):                      # each id as soon as it is sampled
        ...

`stemlm.inference.generate` (`generate`, `stream_tokens`), offloaded generation (`OffloadedLM.stream`), the
continuous-batching server (`stemlm.inference.batching.BatchEngine`, whose step runs `Engine.step` over the
batch) and the playground all decode through it, so sampling, the budget, stop conditions, the seeded generator
and the prompt checks live in one place (`Request`, `SamplingParams`) and the forward in one other (`prefill`,
`step`, run through the model's `InferenceModel` wrapper).

- `prefill(request)` runs the prompt (in chunks of `prefill_chunk` tokens when set, the rows of chunk i + 1
  announced before chunk i runs) into a fresh KV cache sized for the request, and returns the last position's
  logits; the prompt's ids are range-checked there, once. The request's `edit_rows` apply to it alone. A request
  with `prompt_logprobs` has its prompt scored from the same forwards' logits (`Request.score_prompt`): scoring a
  text is its prefill, with `max_tokens=0`. `begin_prefill(request)` is the same prefill as a `Prefill` object
  that runs one chunk per `advance()`, so the batch engine can spread a long prompt over several steps.
- `prefill_together(engine, runs)` runs several fresh one-chunk `Prefill`s in one forward, left-padded under an
  attention mask; the batch engine's step does so with the prompts it admits. A prefill computes the head only
  where logits are used: the last position of the last chunk, unless the prompt is scored.
- `feed(tokens, before)` turns each row's last sampled token into the next forward's [B, 1] ids and announces
  their rows to the row source at once, so that the rows travel while the caller handles the token.
- `step(ids, cache)` runs that forward (a sampled id is in range by construction: no id check) and returns each
  row's next-token logits; the batch engine passes its padding mask and positions.
- `stream(request)` is the loop: prefill, then sample / feed / yield / step until the request finishes (its
  budget, a stop id such as eos, which is kept, or a stop string); each token is yielded before the forward that
  consumes it runs, and arguments are checked at the call, before iteration starts.

Table rows come from the model's row source (`stemlm.inference.rows`); `rows`, given to the engine, go to every
forward over it (a caller's own providers, e.g. a training run's host tables).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from stemlm.errors import StemlmError
from stemlm.inference.inference_model import InferenceModel, as_inference_model
from stemlm.inference.requests import Request
from stemlm.inference.sampling import SamplingParams
from stemlm.model.attention import KVCache
from stemlm.model.decoder import ForwardOptions, StemLM
from stemlm.model.ffn import Rows

CHECKED, UNCHECKED = ForwardOptions(), ForwardOptions(check_ids=False)  # the prefill checks the prompt ids, once
# A prefill chunk that nobody scores needs no logits (NO_HEAD) but at the prompt's end, and only the last one there.
NO_HEAD, LAST_LOGITS = ForwardOptions(head=False), ForwardOptions(last_logits=True)


class Engine:
    """Decoding on one model; see the module docstring. `prefill_chunk`: tokens per prefill forward (None: the
    whole prompt at once); `tokenizer`: needed for requests with stop strings or text events."""

    def __init__(
        self,
        model: StemLM | InferenceModel,
        *,
        tokenizer=None,
        prefill_chunk: int | None = None,
        rows: Rows | None = None,
    ) -> None:
        if prefill_chunk is not None and prefill_chunk < 1:
            raise StemlmError(f"prefill chunk must be >= 1 token, got {prefill_chunk}")
        self.model = as_inference_model(model)
        self.row_source = self.model.row_source
        self.tokenizer, self.prefill_chunk, self.rows = tokenizer, prefill_chunk, rows
        self.device = self.model.device
        self.context = self.model.config.max_position_embeddings

    # ----- the pieces -----
    def start(self, request: Request, context: int | None = None) -> None:
        """Check the request against `context` positions (default: the model's) and seed its generator."""
        if context is None or context == self.context:
            request.start(
                self.device, self.tokenizer, self.context, f"the model's max_position_embeddings={self.context}"
            )
        else:
            request.start(self.device, self.tokenizer, context)

    def begin_prefill(self, request: Request, capacity: int | None = None, chunk: int | None = None) -> Prefill:
        """A `Prefill` of the request's prompt into a fresh KV cache of `capacity` positions, run chunk by chunk
        (`chunk` tokens a forward; default `prefill_chunk`, else the whole prompt)."""
        return Prefill(self, request, capacity, chunk or self.prefill_chunk)

    @torch.no_grad()
    def prefill(self, request: Request, capacity: int | None = None) -> tuple[torch.Tensor, KVCache]:
        """The [V] logits after the prompt and its KV cache (`capacity` positions preallocated)."""
        run = self.begin_prefill(request, capacity)
        while not run.done:
            run.advance(lookahead=True)
        return run.logits, run.cache

    def feed(self, tokens: Sequence[int], before: Sequence[Sequence[int]]) -> torch.Tensor:
        """The [B, 1] ids of the next step (one token a row), their rows announced; `before[b]`: row b's ids
        before its token."""
        host = torch.tensor([[int(token)] for token in tokens])
        ids = host.to(self.device)
        self.row_source.announce(ids, host, before)
        return ids

    @torch.no_grad()
    def step(
        self,
        ids: torch.Tensor,
        cache: KVCache,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One forward of `feed`'s ids continuing `cache`; the [B, V] next-token logits."""
        out = self.model(
            ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            rows=self.rows,
            options=UNCHECKED,
        )
        return out.logits[:, -1]

    # ----- the loop -----
    def stream(self, request: Request) -> Iterator[int]:
        """The request's new token ids, each yielded as soon as it is sampled (checked now, run lazily)."""
        self.start(request)
        return self._decode(request)

    def _decode(self, request: Request) -> Iterator[int]:
        if request.budget == 0 and request.params.prompt_logprobs is None:
            request.finish("length")
            return
        try:
            logits, cache = self.prefill(request, len(request.prompt_ids) + request.budget)  # no regrowth
            if request.budget == 0:  # the prompt scored (`prompt_logprobs`), nothing to generate
                request.finish("length")
                return
            while True:
                finished = request.sample(logits)
                token = request.output_ids[-1]
                if not finished:
                    ids = self.feed([token], [request.history()])  # the rows travel while the caller takes it
                yield token
                if finished:
                    return
                logits = self.step(ids, cache)[0]
        finally:
            self.row_source.drain()  # a caller that stops early leaves an announced step behind

    def generate(self, request: Request) -> list[int]:
        return list(self.stream(request))

    @torch.no_grad()
    def forced_decode(self, prompt: Sequence[int], continuation: Sequence[int]) -> torch.Tensor:
        """Teacher-forced decoding: prefill `prompt`, then feed `continuation` one token per step (as if each had
        been sampled). The [len(continuation) + 1, V] last-position logits of every forward, on the CPU."""
        vocab = self.model.config.vocab_size
        bad = [int(t) for t in continuation if not 0 <= int(t) < vocab]
        if bad:  # fed without the model's id check, like sampled ids: checked here instead
            raise StemlmError(f"continuation token id {bad[0]} is out of range for vocab_size {vocab}")
        request = Request(prompt, SamplingParams(max_tokens=len(continuation)))
        self.start(request)
        logits, cache = self.prefill(request, len(request.prompt_ids) + len(continuation))
        out, history = [logits], list(request.prompt_ids)
        for token in continuation:
            out.append(self.step(self.feed([token], [history]), cache)[0])
            history.append(int(token))
        return torch.stack(out).float().cpu()


class Prefill:
    """One prompt's prefill in progress: `advance()` runs its next chunk of `size` tokens (fixed boundaries, so the
    keys and values do not depend on when each chunk runs); `logits` is the last position's once `done`.

    A chunk's rows are announced to the row source just before it runs; `advance(lookahead=True)` also announces the
    next chunk's, so they travel while this one runs (single-stream prefill). The batch engine interleaves several
    prefills with decode steps and announces only the chunk it runs, keeping announcements in forward order. An
    edited request provides its own rows and announces nothing (the rest are fetched on first use)."""

    def __init__(self, engine: Engine, request: Request, capacity: int | None, size: int | None) -> None:
        self.engine, self.request = engine, request
        self.host = torch.tensor([request.prompt_ids])
        self.length = self.host.shape[1]
        self.size = min(size or self.length, self.length)
        self.cache = KVCache(engine.model.config.num_hidden_layers, capacity=capacity or self.length)
        self.rows = _over(engine.rows, request.edit_rows)
        self.position, self.announced = 0, -1  # prompt tokens run; the last chunk announced
        self.logits: torch.Tensor | None = None
        self.row = 0  # the cache's row that holds this prompt (`prefill_together` shares one cache among prompts)

    @property
    def fits_one_forward(self) -> bool:
        """Nothing run yet, the whole prompt one chunk, no edit of its own: it may run beside others."""
        return self.position == 0 and self.size >= self.length and self.request.edit_rows is None

    @property
    def done(self) -> bool:
        return self.position >= self.length

    @property
    def next_tokens(self) -> int:
        return min(self.size, self.length - self.position)

    def _announce(self, index: int) -> None:
        start = index * self.size
        if self.request.edit_rows is not None or index <= self.announced or start >= self.length:
            return
        host = self.host[:, start : start + self.size]
        self.engine.row_source.announce(host.to(self.engine.device), host, [self.request.prompt_ids[:start]])
        self.announced = index

    @torch.no_grad()
    def advance(self, lookahead: bool = False) -> None:
        index, start = self.position // self.size, self.position
        self._announce(index)
        if lookahead:
            self._announce(index + 1)
        ids = self.host[:, start : start + self.size].to(self.engine.device)
        scored = self.request.params.prompt_logprobs is not None
        last = start + ids.shape[1] >= self.length
        options = _prefill_options(scored, last, ids.shape[1])
        out = self.engine.model(ids, past_key_values=self.cache, use_cache=True, rows=self.rows, options=options)
        if scored:
            self.request.score_prompt(out.logits[0], start)
        self.position += ids.shape[1]
        if self.done:
            self.logits = out.logits[0, -1]


@torch.no_grad()
def prefill_together(engine: Engine, runs: Sequence[Prefill]) -> KVCache:
    """Run fresh prefills whose whole prompt is one chunk (`Prefill.fits_one_forward`) in one forward, and return
    its cache: row b holds `runs[b]`'s prompt right-aligned (positions L - P_b .. L - 1 of L, the longest prompt).

    Shorter prompts are left-padded (id 0) under an attention mask, with positions counting real tokens only (the
    model's left-padding support), so each row's keys, values, decoding state and logits are its prompt's alone;
    equal lengths need no mask. Each run ends `done`, with `logits`, `cache` (the shared one) and `row` set, and its
    prompt scored when asked. Padded ids are announced as they run, so a row source that keys rows by the ids
    around them (n-gram kinds) must get equal lengths only (the batch engine groups them so)."""
    length = max(run.length for run in runs)
    host = torch.zeros((len(runs), length), dtype=torch.long)
    valid = torch.zeros((len(runs), length), dtype=torch.bool)
    for b, run in enumerate(runs):
        host[b, length - run.length :] = run.host[0]
        valid[b, length - run.length :] = True
    ids = host.to(engine.device)
    engine.row_source.announce(ids, host, [[] for _ in runs])
    mask = None if bool(valid.all()) else valid.to(engine.device)
    cache = KVCache(engine.model.config.num_hidden_layers, capacity=length)
    scored = any(run.request.params.prompt_logprobs is not None for run in runs)
    options = _prefill_options(scored, True, length)
    out = engine.model(
        ids, attention_mask=mask, past_key_values=cache, use_cache=True, rows=engine.rows, options=options
    )
    for b, run in enumerate(runs):
        if run.request.params.prompt_logprobs is not None:
            run.request.score_prompt(out.logits[b, length - run.length :], 0)
        run.position, run.logits, run.cache, run.row = run.length, out.logits[b, -1], cache, b
    return cache


def _prefill_options(scored: bool, last: bool, tokens: int) -> ForwardOptions:
    """A prefill chunk's options: all logits when the prompt is scored, else the last only and only at its end. A
    one-token chunk keeps the plain options: it runs as a decoding step (compiled, when steps are), one graph."""
    if scored or tokens == 1:
        return CHECKED
    return LAST_LOGITS if last else NO_HEAD


def _over(base: Rows | None, top: Rows | None) -> Rows | None:
    """`top`'s providers over `base`'s, family by family."""
    if not top:
        return base
    return {**(base or {}), **top}
