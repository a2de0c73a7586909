"""Continuous batching: every active request of a model decoded in one forward per step of the engine.

    from stemlm.inference.batching import BatchEngine
    from stemlm.inference.requests import Request, SamplingParams
    engine = BatchEngine(model, slots=16, tokenizer=tok)          # a StemLM, an InferenceModel or an Engine
    a = engine.submit(Request(ids_a, SamplingParams(max_tokens=20, temperature=0)))
    engine.step(); engine.step()                  # a decodes alone
    b = engine.submit(Request(ids_b, SamplingParams(max_tokens=20, seed=3)))
    engine.run_until_idle()                       # b is prefilled, joins a's batch; each leaves when done
    a.output_ids, b.output_ids                    # exactly what stemlm.inference.generate gives each alone

Layout. The batch shares one time axis of length L in a preallocated KV pool, per layer
[slots, kv_heads, capacity, head_dim]; the active requests are the pool's first rows (a request that leaves
is replaced by the last active row, so the forward reads a prefix view and nothing is gathered). Each row
holds its request's positions right-aligned to L: row b's n_b cached positions are L - n_b .. L - 1. Every
step passes the model `attention_mask` (a row's valid positions; omitted when no row is padded, as for one
request alone) and `position_ids` (n_b), which is how left padding works in the model already, so no model
code knows about batching.

The batch engine schedules; the decoding engine (`stemlm.inference.engine.Engine`) decodes: a request is
prefilled by `Engine.prefill`, every step's forward is `Engine.step` over the active rows (their ids from
`Engine.feed`), and each request samples, counts its budget and checks its stops itself (`Request.sample`), as
in single-stream generation.

Joining. A new request is prefilled alone (the same call as single-stream generation, so its prompt keys,
values and first token are the single-stream ones), then its cache is written
into a free row right-aligned to L; a prompt longer than L first grows the axis on the left (every row moves
right), and an axis longer than its longest row is trimmed back. The n-gram and Engram kinds keep decoding
state per position beside the cache (`KVCache.state`, `stemlm.model.decoding_state`): a joining row's padding
gets each entry's declared padding (ids -1, conv inputs 0), what a sequence start gives, so their keys and conv
see exactly the single-stream context.

Rows from outside. With offloaded tables (the model's row source, `stemlm.offload.lookup_rows.LookupRows`)
one row cache serves the whole batch: each step announces the rows of every active request's next token at
once (the cache de-duplicates them into one gather) and n-gram rows from each row's own previous ids, before
the forward, as single-stream decode prefetches. A request's `edit_rows` (a positional edit) apply to its
prefill only; the edited keys and values then sit in its row and no other request sees them.

Greedy outputs equal single-stream ones (tests/inference/test_batching.py checks every kind): the masked
positions get exactly zero attention weight; a batched matmul may still round differently from a [1, d] one
in the last bit, which can only matter at an exact tie. `EngineLoop` runs `step` on a thread for a server.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import torch

from stemlm.errors import StemlmError
from stemlm.inference.engine import Engine
from stemlm.inference.inference_model import InferenceModel
from stemlm.inference.requests import Request
from stemlm.model.attention import KVCache
from stemlm.model.decoder import StemLM
from stemlm.model.decoding_state import DecodingState


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
    ) -> None:
        """`engine`: the decoding engine, or a model to make one of (with `tokenizer`)."""
        if slots < 1:
            raise StemlmError(f"slots must be >= 1, got {slots}")
        self.engine = engine if isinstance(engine, Engine) else Engine(engine, tokenizer=tokenizer)
        limit = self.engine.context
        self.capacity = limit if capacity is None else capacity
        if not 2 <= self.capacity <= limit:
            raise StemlmError(f"capacity must be in 2..{limit} (max_position_embeddings), got {self.capacity}")
        self.slots, self.max_waiting = slots, max_waiting
        self.keys: list[torch.Tensor] = []  # the pool, allocated at the first join (its dtype is the cache's)
        self.values: list[torch.Tensor] = []
        self.state = DecodingState()  # the lookup kinds' state of the active rows, [n, L, ...]
        self.active: list[Request] = []  # row b of the pool is active[b]
        self.counts: list[int] = []  # cached positions per active row
        self.length = 0  # L, the shared time axis
        self.waiting: deque[Request] = deque()
        self.lock = threading.Lock()  # guards `waiting` and cancellation against the loop thread
        self.steps = 0  # batched decode forwards
        self.tokens = 0  # tokens sampled (first tokens of prefills included)
        self.busy_seconds = 0.0  # time spent in `step`

    # ----- the queue -----
    def submit(self, request: Request) -> Request:
        """Queue a request (it joins at the next step); raises when the waiting queue is full."""
        with self.lock:
            if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
                raise QueueFull(f"the queue is full ({self.max_waiting} requests waiting); retry later")
            self.waiting.append(request)
        return request

    def cancel(self, request: Request) -> None:
        """Stop a request at the next step (its slot is freed there); a finished request is left as it is."""
        request.cancelled = True

    @property
    def busy(self) -> bool:
        return bool(self.active or self.waiting)

    # ----- one step -----
    @torch.no_grad()
    def step(self) -> bool:
        """Admit the waiting requests that fit, then decode one token for every active request.
        Returns False when there was nothing to do."""
        start = time.perf_counter()
        try:
            return self._step()
        finally:
            self.busy_seconds += time.perf_counter() - start

    def _step(self) -> bool:
        self._drop_cancelled()
        while len(self.active) < self.slots:
            with self.lock:
                if not self.waiting:
                    break
                request = self.waiting.popleft()
            if request.cancelled:
                request.finish("cancelled")
            else:
                self._admit(request)
        if not self.active:
            return False
        try:
            logits = self._decode()
        except Exception as exc:  # a failed forward fails the batch it ran, never the loop
            self.fail_all(f"{type(exc).__name__}: {exc}")
            return True
        finished = [b for b, request in enumerate(self.active) if request.sample(logits[b])]
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

    # ----- joining and leaving -----
    def _admit(self, request: Request) -> None:
        try:
            self.engine.start(request, self.capacity)
            if request.budget == 0 and request.params.prompt_logprobs is None:
                request.finish("length")
                return
            logits, cache = self.engine.prefill(request)
            if request.budget == 0:  # the prompt scored (`prompt_logprobs`), nothing to generate
                request.finish("length")
                return
        except Exception as exc:
            self.engine.row_source.drain()
            request.finish("error", str(exc) if isinstance(exc, StemlmError) else f"{type(exc).__name__}: {exc}")
            return
        self.tokens += 1
        if request.sample(logits):
            return  # finished on its first token: it never joins the batch
        self._join(request, cache)

    def _join(self, request: Request, cache: KVCache) -> None:
        P = len(request.prompt_ids)
        if not self.keys:
            shape = lambda t: (self.slots, t.shape[1], self.capacity, t.shape[3])
            self.keys = [torch.zeros(shape(k), dtype=k.dtype, device=k.device) for k in cache.keys]
            self.values = [torch.zeros(shape(v), dtype=v.dtype, device=v.device) for v in cache.values]
        self._realign(max([P, *self.counts]))
        b, L = len(self.active), self.length
        for pool, new in zip(self.keys + self.values, cache.keys + cache.values, strict=True):
            pool[b, :, L - P : L] = new[0, :, :P]
        row = cache.state.map(lambda value, pad: torch.cat([_pad(value, 1, L - P, pad), value[:, :P]], dim=1))
        self.state = self.state.stack(row)
        self.active.append(request)
        self.counts.append(P)

    def _leave(self, b: int) -> None:
        last = len(self.active) - 1
        if b != last:  # the last active row takes the freed one, so the active rows stay a prefix of the pool
            for pool in self.keys + self.values:
                pool[b, :, : self.length] = pool[last, :, : self.length]
            self.active[b], self.counts[b] = self.active[last], self.counts[last]
        self.active.pop()
        self.counts.pop()
        kept = [last if row == b else row for row in range(last)]  # the last row moved into the freed one
        self.state = self.state.map(lambda value, pad: value[kept])
        if not self.active:
            self.length = 0

    def _realign(self, length: int) -> None:
        """Move every active row so that it ends at `length` (>= its count): grow or trim the axis on the left."""
        shift, n, L = length - self.length, len(self.active), self.length
        if shift == 0:
            return
        for pool in self.keys + self.values:
            if shift > 0:
                pool[:n, :, shift : shift + L] = pool[:n, :, :L].clone()
            else:
                pool[:n, :, :length] = pool[:n, :, -shift:L].clone()
        if shift > 0:
            self.state = self.state.map(lambda value, pad: torch.cat([_pad(value, n, shift, pad), value], dim=1))
        else:
            self.state = self.state.map(lambda value, pad: value[:, -shift:])
        self.length = length

    # ----- the batched forward -----
    def _decode(self) -> torch.Tensor:
        """One forward of every active request's last token; returns the [n, V] next-token logits."""
        n = len(self.active)
        if self.length + 1 > self.capacity:
            self._realign(max(self.counts))  # room for one more position: the trimmed axis always has it
        L, device = self.length, self.engine.device
        counts = torch.tensor(self.counts, device=device)
        mask = None  # no row padded (one request, or equal lengths): the single-stream attention, no mask
        if any(c != L for c in self.counts):
            mask = torch.arange(L + 1, device=device)[None, :] >= (L - counts)[:, None]
        ids = self.engine.feed([r.output_ids[-1] for r in self.active], [r.history() for r in self.active])
        cache = KVCache(len(self.keys), capacity=self.capacity, state=self.state)  # the model extends the state
        cache.keys, cache.values = [k[:n] for k in self.keys], [v[:n] for v in self.values]
        cache.lengths = [L] * len(self.keys)
        logits = self.engine.step(ids, cache, attention_mask=mask, position_ids=counts[:, None])
        self.length += 1
        self.counts = [c + 1 for c in self.counts]
        self.steps += 1
        return logits


def _pad(value: torch.Tensor, rows: int, length: int, pad: int) -> torch.Tensor:
    """`length` left-padding positions for `rows` rows of a decoding-state entry like `value`."""
    return value.new_full((rows, length, *value.shape[2:]), pad)


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
