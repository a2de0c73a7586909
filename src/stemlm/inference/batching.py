"""Continuous batching: requests join and leave a running batch, which decodes one token a row per step.

    from stemlm.inference.batching import BatchEngine
    from stemlm.inference.requests import Request, SamplingParams
    engine = BatchEngine(model, slots=16, tokenizer=tok)          # a StemLM, an InferenceModel or an Engine
    a = engine.submit(Request(ids_a, SamplingParams(max_tokens=20, temperature=0)))
    engine.step(); engine.step()                  # a decodes alone
    b = engine.submit(Request(ids_b, SamplingParams(max_tokens=20, seed=3)))
    engine.run_until_idle()                       # b is prefilled, joins a's batch; each leaves when done
    a.output_ids, b.output_ids                    # exactly what stemlm.inference.generate gives each alone

A step. (1) Admission: waiting requests are taken into free slots in fair order (below) and their prompts are
prefilled in chunks of `prefill_chunk` tokens, while the step's token budget lasts: `step_tokens` minus one
token per active row (the decode), and the step's first chunk always runs, so a prompt always progresses. A
prompt longer than a step's budget is prefilled over several steps (chunked prefill) while the batch decodes on:
one long prompt list cannot hold the batch, and one long prompt cannot hold the queue for more than its chunks.
The newly admitted prompts that fit one chunk run together, in one forward left-padded to the longest
(`stemlm.inference.engine.prefill_together`); a prompt of several chunks, an edited one or one of one token runs
alone. A prefill that completes samples the request's first token and the request joins the KV pool. (2) One decode
forward over every active row (`stemlm.inference.kv_pool.KVPool` holds them on one time axis), greedy rows
sampled by one argmax over the batch, the others each by its own seeded generator.

Fair admission. Every sequence counts alone against the slots and the waiting queue's bound, so a request of
64 prompts (or n choices) takes 64 places, as 64 requests would. A request's sequences share a `group` (the API
request they came from; a plain request is its own group). A sequence's rank is the number of its group's
sequences in the engine when it arrived, and a free slot goes to the waiting sequence of the lowest rank, the
earliest among equals: groups take turns a sequence each, and a 6-token request that arrives behind a 64-prompt
one is admitted at the next free slot, not after the other request's remaining prompts.

The batch engine schedules; the decoding engine (`stemlm.inference.engine.Engine`) decodes: a prompt is prefilled
by `Engine.begin_prefill` (chunk by chunk; the chunks' boundaries are fixed, so a prompt's keys and values are
those of a prefill alone in the same chunks), every step's forward is `Engine.step` over the active rows (their
ids from `Engine.feed`), and each request counts its budget and checks its stops itself (`Request.sample`).

Rows from outside. With offloaded tables (the model's row source, `stemlm.offload.lookup_rows.LookupRows`)
one row cache serves the whole batch: each step announces the rows of every active request's next token at
once (the cache de-duplicates them into one gather) and n-gram rows from each row's own previous ids, before
the forward; a prefill chunk announces its own rows just before it runs, so announcements stay in forward order.
A request's `edit_rows` (a positional edit) apply to its prefill only; the edited keys and values then sit in
its row and no other request sees them.

Greedy outputs equal single-stream ones (tests/inference/test_batching.py checks every kind): the masked
positions get exactly zero attention weight; a batched matmul may still round differently from a [1, d] one
in the last bit, which can only matter at an exact tie. `EngineLoop` runs `step` on a thread for a server.
"""

from __future__ import annotations

import threading
import time

import torch

from stemlm.errors import StemlmError
from stemlm.inference.engine import Engine, Prefill, prefill_together
from stemlm.inference.inference_model import InferenceModel
from stemlm.inference.kv_pool import KVPool
from stemlm.inference.requests import Request
from stemlm.inference.rows import ModelTables
from stemlm.model.decoder import StemLM

STEP_TOKENS = 64  # default token budget of one step (decode rows + prefill tokens): docs/serving.md, fairness


class BatchEngine:
    """The batch of active requests over a KV pool of `slots` rows of `capacity` positions each."""

    def __init__(
        self,
        engine: Engine | StemLM | InferenceModel,
        *,
        slots: int = 16,
        capacity: int | None = None,
        tokenizer=None,
        max_waiting: int | None = None,
        step_tokens: int = STEP_TOKENS,
        prefill_chunk: int | None = None,
        batch_prefill: bool = True,
    ) -> None:
        """`engine`: the decoding engine, or a model to make one of (with `tokenizer`); `step_tokens`: a step's
        token budget; `prefill_chunk`: tokens per prefill forward (default: the engine's, at most `step_tokens`);
        `batch_prefill`: a step's newly admitted one-chunk prompts run in one forward (False: one a forward)."""
        if slots < 1:
            raise StemlmError(f"slots must be >= 1, got {slots}")
        if step_tokens < 1:
            raise StemlmError(f"the step token budget must be >= 1, got {step_tokens}")
        self.engine = engine if isinstance(engine, Engine) else Engine(engine, tokenizer=tokenizer)
        limit = self.engine.context
        self.capacity = limit if capacity is None else capacity
        if not 2 <= self.capacity <= limit:
            raise StemlmError(f"capacity must be in 2..{limit} (max_position_embeddings), got {self.capacity}")
        self.slots, self.max_waiting, self.step_tokens = slots, max_waiting, step_tokens
        self.batch_prefill = batch_prefill
        self.prefill_chunk = min(prefill_chunk or self.engine.prefill_chunk or step_tokens, step_tokens)
        self.pool = KVPool(slots, self.capacity)
        self.active: list[Request] = []  # row b of the pool is active[b]
        self.prefilling: list[Prefill] = []  # admitted, prompt not yet fully run (in admission order)
        self.together: list[Prefill] = []  # admitted this step, to be prefilled in one forward at its end
        self.waiting: list[Request] = []
        self.lock = threading.Lock()  # guards `waiting` and cancellation against the loop thread
        self.steps = 0  # batched decode forwards
        self.tokens = 0  # tokens sampled (first tokens of prefills included)
        self.busy_seconds = 0.0  # time spent in `step`

    @property
    def length(self) -> int:
        return self.pool.length

    # ----- the queue -----
    def submit(self, request: Request) -> Request:
        """Queue a request (it joins at the next step); raises when the waiting queue is full."""
        with self.lock:
            if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
                raise QueueFull(f"the queue is full ({self.max_waiting} requests waiting); retry later")
            request.submitted_at = time.perf_counter()
            group = request.group_key
            in_flight = self.active + [run.request for run in self.prefilling + self.together] + self.waiting
            request.rank = sum(1 for r in in_flight if r.group_key == group)  # its place among its group's
            self.waiting.append(request)
        return request

    def cancel(self, request: Request) -> None:
        """Stop a request at the next step (its slot is freed there); a finished request is left as it is."""
        request.cancelled = True

    @property
    def busy(self) -> bool:
        return bool(self.active or self.prefilling or self.waiting)

    def _next_waiting(self) -> Request | None:
        """Take the waiting request of the lowest rank in its group (the earliest among equals): groups take
        turns, one sequence each."""
        with self.lock:
            if not self.waiting:
                return None
            best = min(range(len(self.waiting)), key=lambda i: (self.waiting[i].rank, i))
            return self.waiting.pop(best)

    # ----- one step -----
    @torch.no_grad()
    def step(self) -> bool:
        """Admit and prefill waiting requests within the step's token budget, then decode one token for every
        active request. Returns False when there was nothing to do."""
        start = time.perf_counter()
        try:
            return self._step()
        finally:
            self.busy_seconds += time.perf_counter() - start

    def _step(self) -> bool:
        self._drop_cancelled()
        prefilled = self._prefill(self.step_tokens - len(self.active))
        if not self.active:
            return prefilled
        try:
            logits = self._decode()
        except Exception as exc:  # a failed forward fails the batch it ran, never the loop
            self.fail_all(f"{type(exc).__name__}: {exc}")
            return True
        greedy = [r.params.greedy or r.params.temperature == 0 for r in self.active]
        tokens = logits.argmax(-1).tolist() if any(greedy) else [None] * len(greedy)  # one argmax for the batch
        finished = [b for b, r in enumerate(self.active) if r.sample(logits[b], tokens[b] if greedy[b] else None)]
        self.tokens += len(self.active)
        for b in reversed(finished):
            self._leave(b)
        return True

    def run_until_idle(self) -> None:
        while self.step():
            pass

    def _drop_cancelled(self) -> None:
        for b in reversed(range(len(self.active))):
            if self.active[b].cancelled:
                self.active[b].finish("cancelled")
                self._leave(b)
        for run in [run for run in self.prefilling if run.request.cancelled]:
            self.prefilling.remove(run)
            run.request.finish("cancelled")
        with self.lock:
            for request in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(request)
                request.finish("cancelled")

    def fail_all(self, message: str) -> None:
        """End every active request with "error" and `message` (the loop keeps serving new ones)."""
        self.engine.row_source.drain()  # a prefetched step the failed forward never consumed must not meet the next
        for b in reversed(range(len(self.active))):
            self.active[b].finish("error", message)
            self._leave(b)

    # ----- admission and prefill -----
    def _prefill(self, budget: int) -> bool:
        """Run prefill chunks, those of admitted prompts first, then of newly admitted ones, while `budget` tokens
        last (the first chunk always runs); the newly admitted prompts of one chunk run together in one forward
        at the end. True when any ran or any request was settled."""
        used, acted, ran = 0, False, False
        together = self.together  # admitted this step, prefilled together at its end (they hold their slots)
        while True:
            run = self.prefilling[0] if self.prefilling else self._admit()
            if run is None:
                break
            if run is False:  # a request settled at admission (an error, nothing to generate): look further
                acted = True
                continue
            if ran and used + run.next_tokens > budget:
                break
            used, acted, ran = used + run.next_tokens, True, True
            self.prefilling.remove(run)
            if self._goes_with(run, together):
                together.append(run)
            else:
                self._advance(run)
        self._prefill_together(together)
        self.together = []
        return acted

    def _goes_with(self, run: Prefill, together: list[Prefill]) -> bool:
        """Whether `run` joins the prompts prefilled together this step: a fresh one-chunk prompt without an edit,
        of more than one token (one token runs as a decoding step, compiled where steps are: no graph of its own);
        with rows from outside (host tables), one of the same length only, since those rows are announced
        unpadded."""
        if not self.batch_prefill or not run.fits_one_forward or run.length == 1:
            return False
        return not together or isinstance(self.engine.row_source, ModelTables) or run.length == together[0].length

    def _advance(self, run: Prefill) -> None:
        """Run one chunk of `run` (taken out of `prefilling`): it goes back there unless done or failed."""
        try:
            run.advance()
        except Exception as exc:
            self.engine.row_source.drain()
            _fail(run.request, exc)
            return
        if run.done:
            self._complete(run)
        else:
            self.prefilling.insert(0, run)

    def _prefill_together(self, runs: list[Prefill]) -> None:
        """One forward for all of `runs` (one alone runs as it would alone); if it fails (say, one bad prompt id),
        each runs alone, so only a bad prompt fails."""
        if len(runs) < 2:
            for run in runs:
                self._advance(run)
            return
        try:
            prefill_together(self.engine, runs)
        except Exception:
            self.engine.row_source.drain()
            for run in runs:
                self._advance(run)
            return
        for run in runs:
            self._complete(run)

    def _admit(self) -> Prefill | None | bool:
        """Admit the next waiting request when a slot is free: its `Prefill`; None when none is admitted; False
        when the request admitted ended at once (cancelled, a bad prompt, nothing to generate)."""
        if len(self.active) + len(self.prefilling) + len(self.together) >= self.slots:
            return None
        request = self._next_waiting()
        if request is None:
            return None
        request.admitted_at = time.perf_counter()
        if request.cancelled:
            request.finish("cancelled")
            return False
        try:
            self.engine.start(request, self.capacity)
            if request.budget == 0 and request.params.prompt_logprobs is None:
                request.finish("length")
                return False
            run = self.engine.begin_prefill(request, chunk=self.prefill_chunk)
        except Exception as exc:
            _fail(request, exc)
            return False
        self.prefilling.append(run)
        return run

    def _complete(self, run: Prefill) -> None:
        """A prompt fully prefilled: score-only requests end; the others sample their first token and join."""
        request = run.request
        if request.budget == 0:  # the prompt scored (`prompt_logprobs`), nothing to generate
            request.finish("length")
            return
        self.tokens += 1
        if request.sample(run.logits):
            return  # finished on its first token: it never joins the batch
        self.pool.join(run.cache, len(request.prompt_ids), run.row)
        self.active.append(request)

    def _leave(self, b: int) -> None:
        self.pool.leave(b)
        last = len(self.active) - 1
        self.active[b] = self.active[last]
        self.active.pop()

    # ----- the batched forward -----
    def _decode(self) -> torch.Tensor:
        """One forward of every active request's last token; returns the [n, V] next-token logits."""
        cache, mask, positions = self.pool.step_inputs()
        ids = self.engine.feed([r.output_ids[-1] for r in self.active], [r.history() for r in self.active])
        logits = self.engine.step(ids, cache, attention_mask=mask, position_ids=positions)
        self.pool.advance(cache)
        self.steps += 1
        return logits


def _fail(request: Request, exc: Exception) -> None:
    request.finish("error", str(exc) if isinstance(exc, StemlmError) else f"{type(exc).__name__}: {exc}")


class QueueFull(StemlmError):
    """The engine's waiting queue is at its bound (a server answers 429)."""


class ShuttingDown(StemlmError):
    """The engine loop is stopping and takes no new request (a server answers 503)."""


class EngineLoop:
    """`BatchEngine.step` on a background thread: it sleeps while idle and wakes on `submit`."""

    def __init__(self, engine: BatchEngine) -> None:
        self.engine = engine
        self.wake = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="stemlm-batch", daemon=True)
        self.thread.start()

    def submit(self, request: Request) -> Request:
        if self.stopping:
            raise ShuttingDown("the server is shutting down")
        self.engine.submit(request)
        with self.wake:
            self.wake.notify()
        return request

    def cancel(self, request: Request) -> None:
        self.engine.cancel(request)
        with self.wake:
            self.wake.notify()

    def _run(self) -> None:
        while True:
            with self.wake:
                while not self.engine.busy and not self.stopping:
                    self.wake.wait()
                if self.stopping and not self.engine.busy:
                    return
            try:
                self.engine.step()
            except Exception as exc:  # e.g. a client callback that raised: fail what ran, keep serving
                self.engine.fail_all(f"{type(exc).__name__}: {exc}")

    def stop(self, cancel: bool = False, timeout: float | None = None) -> None:
        """Refuse new requests, finish (or with `cancel`, cancel) the ones in flight, and join the thread."""
        self.stopping = True
        if cancel:
            with self.engine.lock:
                pending = list(self.engine.waiting)
            for request in self.engine.active + pending:
                self.engine.cancel(request)
        with self.wake:
            self.wake.notify()
        self.thread.join(timeout)
