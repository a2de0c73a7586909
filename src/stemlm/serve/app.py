"""The playground's web app (Flask): the page, its JSON API and the streamed generation.

    from stemlm.serve import Playground, create_app
    app = create_app(Playground.load("runs/tiny"))      # a WSGI app; `stemlm serve` runs it threaded

Routes (every /api answer is JSON; a bad request gets 4xx with `{"error": message}`, never a traceback; a body
over 1 MiB gets 413, announced or chunked; a Host header outside `trusted_hosts` gets 400, compared by
`hosts.host_allowed`, which reads IPv6 literals as addresses):

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
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from flask import Flask, Response, jsonify, request, send_from_directory
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from stemlm.edit import PAD_ROWS, STRATEGIES
from stemlm.edit.positional import ROW_KINDS
from stemlm.edit.shared_tokens import SharedSubwords
from stemlm.errors import StemlmError
from stemlm.inference.requests import IncrementalDecoder  # text pieces that never split a multi-byte character
from stemlm.serve.editing import EditSpec
from stemlm.serve.hosts import host_allowed, trusted_hosts
from stemlm.serve.params import Body, parse_json, sampling
from stemlm.serve.playground import Conflict, Playground

log = logging.getLogger("stemlm.serve")
MAX_BODY = 1 << 20


def web_dir() -> Path:
    return Path(str(resources.files("stemlm").joinpath("assets", "web")))


def sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


def read_body(stream) -> bytes:
    """The request body, or 413 once past MAX_BODY. werkzeug refuses a longer Content-Length itself, but cuts a
    chunked body silently at the limit (it raises only on the read after), which would parse as truncated JSON."""
    raw = bytearray()
    while chunk := stream.read(MAX_BODY + 1 - len(raw)):
        raw += chunk
        if len(raw) > MAX_BODY:
            break
    if len(raw) > MAX_BODY or (len(raw) == MAX_BODY and stream.read(1)):
        raise RequestEntityTooLarge(f"the request body is over {MAX_BODY} bytes; the playground takes at most that")
    return bytes(raw)


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
        rows=body.choice("rows", "stem", ROW_KINDS),
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


def create_app(pg: Playground, hosts: Sequence[str] | None = None) -> Flask:
    """The WSGI app; `hosts`: the accepted Host header names (default `trusted_hosts()`: loopback only)."""
    app = Flask(__name__, static_folder=str(web_dir()), static_url_path="/static")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY
    allowed = list(hosts) if hosts is not None else trusted_hosts()
    app.json.sort_keys = False

    @app.before_request
    def check_host():  # not Flask's TRUSTED_HOSTS: werkzeug cuts "[::ffff:203.0.113.9]" at its first colon
        if not host_allowed(request.headers.get("Host", ""), allowed):
            return jsonify(error="this server does not answer that Host header"), 400
        return None

    @app.errorhandler(StemlmError)
    def user_error(exc: StemlmError):
        if isinstance(exc, SharedSubwords):  # a question for the user: the page lists the words and asks
            return jsonify(error=str(exc), changed_tokens=exc.changed_tokens), 409
        return jsonify(error=str(exc)), 409 if isinstance(exc, Conflict) else 400

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        return jsonify(error=f"{exc.name}: {exc.description}"), exc.code

    @app.errorhandler(Exception)
    def internal_error(exc: Exception):
        log.error("request %s failed:\n%s", request.path, traceback.format_exc())
        return jsonify(error=f"internal error ({type(exc).__name__}); see the server log"), 500

    def body() -> Body:
        if not request.is_json:
            raise StemlmError("the request body must be a JSON object (Content-Type: application/json)")
        return Body(parse_json(read_body(request.stream)))

    @app.get("/")
    def index():
        return send_from_directory(web_dir(), "index.html")

    @app.get("/api/info")
    def info():
        return jsonify(pg.info())

    @app.post("/api/tokenize")
    def tokenize():
        return jsonify(tokens=pg.tokens(pg.encode(body().text("prompt"))))

    @app.post("/api/generate")
    def generate():
        b = body()
        ids = pg.encode(b.text("prompt"))
        tokens = pg.stream(ids, sampling(b))
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return Response(_token_events(pg, tokens, time.perf_counter()), mimetype="text/event-stream", headers=headers)

    @app.get("/api/stats")
    def stats():
        return jsonify(cache=pg.cache_report())

    @app.post("/api/contribution")
    def contribution():
        return jsonify(pg.contribution(pg.encode(body().text("prompt"))))

    @app.post("/api/nearest")
    def nearest():
        b = body()
        vocab = pg.model.config.vocab_size
        return jsonify(pg.nearest(b.integer("token_id", 0, 0, vocab - 1), b.integer("k", 8, 1, 50)))

    @app.post("/api/edit")
    def edit():
        b = body()
        ids = pg.encode(b.text("prompt"))
        spec = edit_spec(b)
        return jsonify(pg.edit(ids, spec, top_k=b.integer("show_top", 8, 1, 50), sampling=sampling(b)))

    @app.post("/api/save")
    def save():
        b = body()
        ids = pg.encode(b.text("prompt"))
        allow = b.boolean("allow_shared_subwords", False)
        return jsonify(pg.save(ids, edit_spec(b), b.text("name").strip(), allow_shared=allow))

    return app
