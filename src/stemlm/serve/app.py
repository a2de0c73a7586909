"""The one web app of `stemlm serve` (FastAPI): the playground page and its JSON API, and the OpenAI-compatible API.

    from stemlm.serve import Playground, create_app
    app = create_app(Playground.load("runs/tiny"))      # an ASGI app; `stemlm serve` runs it under uvicorn

Both halves answer from the one `ServedModel` (`stemlm.serve.served_model`): one loaded checkpoint whose batch
engine decodes the page's generations and the API's requests together. The `/v1` routes, `/metrics` and
`/health` are `stemlm.serve.openai_app`'s; the page's are below. Every page /api answer is JSON; a bad request
gets 4xx with `{"error": message}`, never a traceback; a body over 1 MiB gets 413, announced or chunked; a Host
header outside `hosts` gets 400 on every route, compared by `hosts.host_allowed`, which reads IPv6 literals as
addresses:

    GET  /                  the page (vanilla HTML/JS/CSS from stemlm/assets/web, nothing from a CDN)
    GET  /api/info          the checkpoint: layers, STEM layers, table placement, edit strategies, saving
    POST /api/tokenize      {prompt} -> tokens
    POST /api/generate      {prompt, max_new_tokens, greedy, temperature, top_k, top_p, seed} -> a stream of
                            server-sent events: `token` {id, text} per new token, then `done` {completion,
                            tokens/s, cache statistics with host tables} or `error` {error}
    GET  /api/stats         memory and row-cache statistics (host tables), or {"cache": null}
    POST /api/contribution  {prompt} -> per STEM layer and position: FFN output norm, gradient x input
    POST /api/nearest       {token_id, k} -> nearest tokens by row cosine per STEM layer and embedding
    POST /api/edit          {prompt, target, source | span, strategy, pad, layers, rows, show_top, sampling...}
                            -> before/after top `show_top` next-token probabilities and continuations
    POST /api/save          the same edit fields + {name, allow_shared_subwords} -> a global edit saved under
                            --save-dir/name with its `edit` description (`changed_tokens`: each {id, token,
                            shared_with}); when other words share a changed token and allow_shared_subwords is
                            not true, 409 with {error, changed_tokens} and nothing saved (the CLI's rule)
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from collections.abc import Callable, Sequence
from http import HTTPStatus
from importlib import resources
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from stemlm.choices import EDIT_ROW_ALIASES, EDIT_ROWS, edit_row_kind
from stemlm.edit import PAD_ROWS, STRATEGIES
from stemlm.edit.shared_tokens import SharedSubwords
from stemlm.errors import StemlmError
from stemlm.inference.batching import QueueFull, ShuttingDown
from stemlm.inference.requests import IncrementalDecoder  # text pieces that never split a multi-byte character
from stemlm.serve.editing import EditSpec
from stemlm.serve.hosts import host_allowed, trusted_hosts
from stemlm.serve.openai_app import add_api_routes, error_body
from stemlm.serve.params import Body, BodyTooLarge, parse_json, read_body, sampling
from stemlm.serve.playground import Conflict, Playground

log = logging.getLogger("stemlm.serve")


def web_dir() -> Path:
    return Path(str(resources.files("stemlm").joinpath("assets", "web")))


def sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


def is_api_path(path: str) -> bool:
    """Whether a path is the OpenAI-compatible API's (its errors take OpenAI's shape, the page's `{"error"}`)."""
    return path == "/v1" or path.startswith("/v1/")


def page_error(message: str, status: int, **extra) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status)


class HostCheck:
    """400 for a Host header outside `allowed`. Plain ASGI: a `BaseHTTPMiddleware` would wrap `receive` so that
    `Request.is_disconnected` never sees the client leave."""

    def __init__(self, app, allowed: Sequence[str]) -> None:
        self.app, self.allowed = app, list(allowed)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if not host_allowed(host, self.allowed):
                message = "this server does not answer that Host header"
                body = error_body(message) if is_api_path(scope["path"]) else {"error": message}
                await JSONResponse(body, status_code=400)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def edit_spec(body: Body) -> EditSpec:
    span = body.int_list("span")
    if span is not None and len(span) != 2:
        raise StemlmError(f"span must be [start, end] token positions, got {list(span)}")
    return EditSpec(
        target=body.text("target"),
        source=None if span is not None else body.optional_text("source"),
        span=span,
        strategy=body.choice("strategy", "auto", STRATEGIES),
        pad=body.choice("pad", "", ("", *PAD_ROWS)) or None,  # "" or absent: the editing module's default
        layers=body.int_list("layers"),
        rows=edit_row_kind(body.choice("rows", "tables", (*EDIT_ROWS, *EDIT_ROW_ALIASES))),
    )


def _token_events(pg: Playground, tokens, start: float):
    """The server-sent events of one generation: printable text pieces as tokens come, then a summary."""
    decoder, count = IncrementalDecoder(pg.tokenizer), 0
    try:
        for token in tokens:
            count += 1
            yield sse("token", {"id": token, "text": decoder.push(token)})
        tail = decoder.flush()
        if tail:
            yield sse("token", {"id": None, "text": tail})
        seconds = time.perf_counter() - start
        yield sse(
            "done",
            {
                "completion": pg.tokenizer.decode(decoder.ids),
                "num_tokens": count,
                "seconds": seconds,
                "tokens_per_s": count / seconds if seconds > 0 else 0.0,
                "cache": pg.cache_report(),
            },
        )
    except StemlmError as exc:  # headers are sent already: the error travels as an event
        yield sse("error", {"error": str(exc)})
    except Exception as exc:
        log.error("generation failed:\n%s", traceback.format_exc())
        yield sse("error", {"error": f"internal error ({type(exc).__name__}); see the server log"})
    finally:
        if hasattr(tokens, "close"):
            tokens.close()  # a client that went away: the request is cancelled, its slot freed


def _status_of(exc: StemlmError) -> int:
    if isinstance(exc, BodyTooLarge):
        return 413
    if isinstance(exc, QueueFull):
        return 429
    if isinstance(exc, ShuttingDown):
        return 503
    return 409 if isinstance(exc, Conflict) else 400


def _page_route(handler: Callable) -> Callable:
    """A page route whose errors become `{"error": message}` answers (a shared-subwords refusal names the tokens)."""

    async def route(request: Request):
        try:
            return await handler(request)
        except SharedSubwords as exc:  # a question for the user: the page lists the words and asks
            return page_error(str(exc), 409, changed_tokens=exc.changed_tokens)
        except StemlmError as exc:
            return page_error(str(exc), _status_of(exc))
        except Exception as exc:
            log.error("request %s failed:\n%s", request.url.path, traceback.format_exc())
            return page_error(f"internal error ({type(exc).__name__}); see the server log", 500)

    return route


async def _body(request: Request) -> Body:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json" and not kind.endswith("+json"):
        raise StemlmError("the request body must be a JSON object (Content-Type: application/json)")
    return Body(parse_json(await read_body(request)))


def add_page_routes(app: FastAPI, pg: Playground) -> None:
    """The playground's page and /api routes (see the module docstring)."""
    app.mount("/static", StaticFiles(directory=web_dir()), name="static")

    def page(method: str, path: str):
        def register(handler: Callable) -> Callable:
            app.add_api_route(path, _page_route(handler), methods=[method], include_in_schema=False)
            return handler

        return register

    @page("GET", "/")
    async def index(request: Request):
        return FileResponse(web_dir() / "index.html")

    @page("GET", "/api/info")
    async def info(request: Request):
        return JSONResponse(await run_in_threadpool(pg.info))

    @page("POST", "/api/tokenize")
    async def tokenize(request: Request):
        b = await _body(request)
        return JSONResponse({"tokens": pg.tokens(pg.encode(b.text("prompt")))})

    @page("POST", "/api/generate")
    async def generate(request: Request):
        b = await _body(request)
        ids = pg.encode(b.text("prompt"))
        tokens = pg.stream(ids, sampling(b))
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        events = _token_events(pg, tokens, time.perf_counter())  # iterated on a worker thread by Starlette
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)

    @page("GET", "/api/stats")
    async def stats(request: Request):
        return JSONResponse({"cache": await run_in_threadpool(pg.cache_report)})

    @page("POST", "/api/contribution")
    async def contribution(request: Request):
        b = await _body(request)
        return JSONResponse(await run_in_threadpool(pg.contribution, pg.encode(b.text("prompt"))))

    @page("POST", "/api/nearest")
    async def nearest(request: Request):
        b = await _body(request)
        vocab = pg.model.config.vocab_size
        token_id, k = b.integer("token_id", 0, 0, vocab - 1), b.integer("k", 8, 1, 50)
        return JSONResponse(await run_in_threadpool(pg.nearest, token_id, k))

    @page("POST", "/api/edit")
    async def edit(request: Request):
        b = await _body(request)
        ids = pg.encode(b.text("prompt"))
        spec, top_k, settings = edit_spec(b), b.integer("show_top", 8, 1, 50), sampling(b)
        return JSONResponse(await run_in_threadpool(lambda: pg.edit(ids, spec, top_k=top_k, sampling=settings)))

    @page("POST", "/api/save")
    async def save(request: Request):
        b = await _body(request)
        ids = pg.encode(b.text("prompt"))
        spec, name, allow = edit_spec(b), b.text("name").strip(), b.boolean("allow_shared_subwords", False)
        return JSONResponse(await run_in_threadpool(lambda: pg.save(ids, spec, name, allow_shared=allow)))


def create_app(pg: Playground, hosts: Sequence[str] | None = None) -> FastAPI:
    """The ASGI app; `hosts`: the accepted Host header names (default `trusted_hosts()`: loopback only)."""
    app = FastAPI(title="stemlm", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(HostCheck, allowed=list(hosts) if hosts is not None else trusted_hosts())

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):  # an unknown route, a wrong method
        message = f"{HTTPStatus(exc.status_code).phrase}: {exc.detail}"
        body = error_body(message) if is_api_path(request.url.path) else {"error": message}
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    add_api_routes(app, pg.served)
    add_page_routes(app, pg)
    return app
