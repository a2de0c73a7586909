"""The OpenAI-compatible HTTP API of `stemlm serve`: the `/v1` routes on the server's one app (`stemlm.serve.app`).

    add_api_routes(app, served)        # served: the `ServedModel` the page's routes use too

Routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (streamed as server-sent events
with `"stream": true`, ending in `data: [DONE]`), `GET /metrics` (Prometheus text), `GET /health`.
A body's choices (its prompts x `n`) are one engine request each, decoded together in the batch and answered
in OpenAI's order (index = prompt * n + j; streamed chunks carry their index); `echo` puts each prompt, and with
`logprobs` its tokens' log-probabilities (scored by the prefill), before its completion.
Errors come in OpenAI's shape `{"error": {"message", "type", "param", "code"}}` with one line of message:
400 for a bad body (`stemlm.serve.openai_params`), 404 for another model name, 413 for a body over 1 MiB
(read no further than that, announced or chunked),
429 when the engine's queue is full, 503 while shutting down, 504 when a request runs past the server's
timeout (it is cancelled). A Host header outside the app's trusted hosts gets 400 (DNS rebinding). A client
that disconnects cancels its request: its slot is freed at the next decode step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from stemlm.errors import StemlmError
from stemlm.inference.batching import QueueFull, ShuttingDown
from stemlm.serve.metrics import Metrics
from stemlm.serve.openai_params import parse_chat, parse_completion
from stemlm.serve.params import BodyTooLarge, parse_json, read_body
from stemlm.serve.served_model import ServedModel

POLL_SECONDS = 0.25  # how often a waiting non-streamed request checks for a disconnected client


class ClientGone(Exception):
    """The client disconnected while its request ran."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_body(message: str, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def add_api_routes(app: FastAPI, served: ServedModel) -> None:
    """`/health`, `/v1/models`, `/v1/completions`, `/v1/chat/completions` and `/metrics` on `app`."""
    metrics = Metrics(served)
    app.state.served, app.state.metrics = served, metrics

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return JSONResponse(error_body(exc.message, exc.kind), status_code=exc.status)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": served.name, "object": "model", "created": served.created, "owned_by": "stemlm"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(served, metrics, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(served, metrics, request, chat=True)


async def _body(request: Request):
    try:
        return parse_json(await read_body(request))
    except BodyTooLarge as exc:
        raise ApiError(413, str(exc)) from None
    except StemlmError as exc:
        raise ApiError(400, str(exc)) from None


async def _generate(service: ServedModel, metrics: Metrics, http: Request, chat: bool):
    endpoint = "chat" if chat else "completions"
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    submitted = []
    try:
        body = await _body(http)
        parse = parse_chat if chat else parse_completion
        parsed = parse(body, service.context, service.chat_stop_ids if chat else service.stop_ids)
        if isinstance(body, dict) and body.get("model") not in (None, service.name):
            raise ApiError(404, f"model {body['model']!r} does not exist; this server serves {service.name!r}")
        requests = service.requests(parsed, lambda index: _poster(loop, events, index))
        places = service.engine.max_waiting
        if len(requests) > 1 and places is not None and len(requests) > places:  # could never be admitted
            raise QueueFull(f"{len(requests)} completions do not fit the queue ({places} places); ask for fewer")
        for request in requests:
            submitted.append(service.loop.submit(request))
    except (ApiError, StemlmError) as exc:
        for request in submitted:  # a full queue part-way: the choices already queued are withdrawn
            service.loop.cancel(request)
        status, kind = 400, "invalid_request_error"
        if isinstance(exc, QueueFull):
            status, kind = 429, "rate_limit_error"
        elif isinstance(exc, ShuttingDown):
            status, kind = 503, "server_error"
        elif isinstance(exc, ApiError):
            status, kind = exc.status, exc.kind
        metrics.requests.labels(endpoint, "rejected").inc()
        raise ApiError(status, str(exc).splitlines()[0] if str(exc) else type(exc).__name__, kind) from None
    for request in requests[:: parsed.n]:  # each prompt once, as OpenAI counts prompt tokens
        metrics.prompt_tokens.inc(len(request.prompt_ids))
    run = _Run(service, metrics, http, parsed, requests, events, endpoint)
    if parsed.stream:
        return StreamingResponse(run.stream(chat, parsed.include_usage), media_type="text/event-stream")
    return await run.complete(chat)


def _poster(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, index: int):
    """The engine-thread callback that hands choice `index`'s events to its handler on the event loop."""

    def post(request, event) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, (index, event))
        except RuntimeError:  # the event loop has closed (the server stopped): nobody is waiting for it
            pass

    return post


class _Run:
    """One admitted API request, its choices' engine requests (prompt-major, index = prompt * n + j): their
    events read on the event loop, with timeout and disconnect checks."""

    def __init__(self, service, metrics, http, parsed, requests, events, endpoint) -> None:
        self.service, self.metrics, self.http, self.events = service, metrics, http, events
        self.parsed, self.requests, self.endpoint = parsed, requests, endpoint
        self.id = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.start = self.checked = time.perf_counter()
        self.deadline = self.start + service.request_timeout
        self.last = [self.start] * len(requests)  # per choice: when its last token came
        self.tokens = [0] * len(requests)
        self.running = len(requests)

    def cancel_all(self) -> None:
        for request in self.requests:
            self.service.loop.cancel(request)

    async def next_event(self):
        """The next (choice index, engine event) (None: every choice finished); raises TimeoutError past the
        deadline (the requests cancelled) and ClientGone when the client has disconnected (checked every
        POLL_SECONDS, events or not)."""
        while self.running:
            now = time.perf_counter()
            left = self.deadline - now
            if left <= 0:
                self.cancel_all()
                raise TimeoutError
            if now - self.checked >= POLL_SECONDS:
                self.checked = now
                if await self.http.is_disconnected():
                    raise ClientGone
            try:
                index, event = await asyncio.wait_for(self.events.get(), min(POLL_SECONDS, left))
            except TimeoutError:
                continue
            if event is None:
                self.running -= 1
                continue
            if event.token_id >= 0:
                now = time.perf_counter()
                first = self.tokens[index] == 0
                (self.metrics.first_token if first else self.metrics.inter_token).observe(now - self.last[index])
                self.last[index], self.tokens[index] = now, self.tokens[index] + 1
            return index, event
        return None

    def settle(self) -> None:
        """Count the request once it is over (each choice by its finish reason); choices still running (client
        gone, timeout) are cancelled, which frees their slots at the next step."""
        for request in self.requests:
            if not request.done.is_set():
                self.service.loop.cancel(request)
            self.metrics.requests.labels(self.endpoint, request.finish_reason or "cancelled").inc()
            self.metrics.generated_tokens.inc(len(request.output_ids))
            if request.admitted_at is not None:
                self.metrics.queue_wait.observe(request.admitted_at - request.submitted_at)
        self.metrics.latency.observe(time.perf_counter() - self.start)

    def usage(self) -> dict:
        """Token counts summed over the choices, each prompt counted once (OpenAI's and vLLM's way with n > 1)."""
        prompt = sum(len(r.prompt_ids) for r in self.requests[:: self.parsed.n])
        done = sum(len(r.output_ids) for r in self.requests)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def head(self, chat: bool, chunk: bool) -> dict:
        kind = ("chat.completion" if chat else "text_completion") + (".chunk" if chat and chunk else "")
        return {"id": self.id, "object": kind, "created": int(time.time()), "model": self.service.name}

    def finish_reason(self, request) -> str:
        """OpenAI's finish reason ("length" or "stop"); an engine error is a 500, a request the server
        cancelled while its client still waited (shutdown) a 503."""
        if request.finish_reason == "error":
            raise ApiError(500, f"generation failed: {request.error}", "server_error")
        if request.finish_reason == "cancelled":
            raise ApiError(503, "the server stopped before the request finished", "server_error")
        return request.finish_reason

    async def complete(self, chat: bool):
        collected = [[] for _ in self.requests]
        try:
            while (item := await self.next_event()) is not None:
                collected[item[0]].append(item[1])
        except TimeoutError:
            message = f"the request ran past the server's {self.service.request_timeout:g} s timeout"
            raise ApiError(504, message, "timeout") from None
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; nginx's code for a closed client connection
        finally:
            self.settle()
        reasons = [self.finish_reason(request) for request in self.requests]
        choices = []
        for index, (request, events) in enumerate(zip(self.requests, collected, strict=True)):
            logprobs = _logprobs(self.service.tokenizer, events, chat, request.params.logprobs)
            if chat:
                choice = {"index": index, "message": {"role": "assistant", "content": request.text}}
                choice["logprobs"] = logprobs
            else:
                choice = {"index": index, "text": request.text, "logprobs": logprobs}
                if self.parsed.echo:
                    self.echo(choice, index)
            choice["finish_reason"] = reasons[index]
            choices.append(choice)
        return {**self.head(chat, False), "choices": choices, "usage": self.usage()}

    def echo(self, choice: dict, index: int) -> None:
        """Put choice `index`'s prompt before its text and, with logprobs, the prompt tokens' before its own
        (scored by its prompt's first choice; the first prompt token has none, as in OpenAI's and vLLM's)."""
        prompt = self.parsed.prompts[index // self.parsed.n]
        tokenizer, first = self.service.tokenizer, self.requests[index - index % self.parsed.n]
        choice["text"] = (prompt if isinstance(prompt, str) else tokenizer.decode(prompt)) + choice["text"]
        if choice["logprobs"] is None:
            return
        scored = _logprobs(tokenizer, first.prompt_logprobs or [], False, first.params.prompt_logprobs)
        scored["token_logprobs"][0], scored["top_logprobs"][0] = None, None
        merged = {key: scored[key] + choice["logprobs"][key] for key in scored}
        merged["text_offset"] = _offsets(merged["tokens"])
        choice["logprobs"] = merged

    async def stream(self, chat: bool, include_usage: bool):
        tokenizer = self.service.tokenizer
        try:
            if chat:
                for index in range(len(self.requests)):
                    start = _delta({"role": "assistant", "content": ""}, index=index)
                    yield _sse({**self.head(chat, True), "choices": [start]})
            while (item := await self.next_event()) is not None:
                index, event = item
                want = self.requests[index].params.logprobs
                logprobs = _logprobs(tokenizer, [event], chat, want) if event.token_id >= 0 else None
                if chat:
                    part = _delta({"content": event.text}, logprobs, index=index)
                else:
                    part = _text_choice(event.text, logprobs, index=index)
                yield _sse({**self.head(chat, True), "choices": [part]})
            for index, request in enumerate(self.requests):
                try:
                    reason = self.finish_reason(request)
                except ApiError as exc:
                    yield _sse(error_body(exc.message, exc.kind))
                    return
                last = _delta({}, None, reason, index) if chat else _text_choice("", None, reason, index)
                yield _sse({**self.head(chat, True), "choices": [last]})
            if include_usage:
                yield _sse({**self.head(chat, True), "choices": [], "usage": self.usage()})
            yield "data: [DONE]\n\n"
        except TimeoutError:
            message = f"the request ran past the server's {self.service.request_timeout:g} s timeout"
            yield _sse(error_body(message, "timeout"))
        except ClientGone:
            return
        finally:
            self.settle()


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _delta(delta: dict, logprobs=None, finish_reason=None, index: int = 0) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def _text_choice(text: str, logprobs=None, finish_reason=None, index: int = 0) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def _offsets(tokens: list[str]) -> list[int]:
    """Each token's character offset in the text the tokens concatenate to."""
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return offsets


def _logprobs(tokenizer, events, chat: bool, wanted):
    """OpenAI's logprobs object for these token events (None when the request asked for none)."""
    events = [e for e in events if e.token_id >= 0]
    if wanted is None:
        return None
    piece = lambda i: tokenizer.decode([i])
    if chat:

        def entry(i, lp):
            token = piece(i)
            return {"token": token, "logprob": lp, "bytes": list(token.encode())}

        content = [
            {**entry(e.token_id, e.logprob), "top_logprobs": [entry(i, lp) for i, lp in e.top_logprobs or []]}
            for e in events
        ]
        return {"content": content}
    tokens = [piece(e.token_id) for e in events]
    top = [{piece(i): lp for i, lp in e.top_logprobs or []} for e in events]
    logprobs = [e.logprob for e in events]
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": _offsets(tokens)}
