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
  text is its prefill, with `max_tokens=0`.
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

    @torch.no_grad()
    def prefill(self, request: Request, capacity: int | None = None) -> tuple[torch.Tensor, KVCache]:
        """The [V] logits after the prompt and its KV cache (`capacity` positions preallocated)."""
        prompt_cpu = torch.tensor([request.prompt_ids])
        prompt = prompt_cpu.to(self.device)
        size = self.prefill_chunk or prompt.shape[1]
        host_chunks, chunks = prompt_cpu.split(size, dim=1), prompt.split(size, dim=1)
        # An edit provides its own rows for the families it changes; the rest are fetched on first use.
        announce = request.edit_rows is None
        if announce:
            self.row_source.announce(chunks[0], host_chunks[0], [()])
        cache = KVCache(self.model.config.num_hidden_layers, capacity=capacity or prompt.shape[1])
        rows = _over(self.rows, request.edit_rows)
        for i, ids in enumerate(chunks):
            if announce and i + 1 < len(chunks):
                self.row_source.announce(chunks[i + 1], host_chunks[i + 1], [request.prompt_ids[: (i + 1) * size]])
            out = self.model(ids, past_key_values=cache, use_cache=True, rows=rows, options=CHECKED)
            if request.params.prompt_logprobs is not None:
                request.score_prompt(out.logits[0], i * size)
        return out.logits[0, -1], cache

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


def _over(base: Rows | None, top: Rows | None) -> Rows | None:
    """`top`'s providers over `base`'s, family by family."""
    if not top:
        return base
    return {**(base or {}), **top}
