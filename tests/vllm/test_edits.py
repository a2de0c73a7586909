"""`stemlm.vllm.edits.RefuseEdits` (the ASGI middleware for `vllm serve --middleware`) answers 400 to a completion or
chat request that carries `edit` or `stem_edit` and hands every other request to the app with its body whole; pure
ASGI, so it runs here without vLLM (test_serve.py runs it inside vLLM's server)."""

from __future__ import annotations

import asyncio
import json

import pytest

from stemlm.vllm.edits import RefuseEdits


def call(path: str, body: bytes, method: str = "POST", chunks: int = 1):
    """(what the app received, or None if it was not called; the messages sent to the client)."""
    received, sent = [], []

    async def app(scope, receive, send):
        message = await receive()
        received.append(message["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})

    half = len(body) // 2
    parts = [body] if chunks == 1 else [body[:half], body[half:]]  # a body may arrive in several messages
    incoming = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]

    async def receive():
        return incoming.pop(0)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path}
    asyncio.run(RefuseEdits(app)(scope, receive, send))
    return (received[0] if received else None), sent


@pytest.mark.parametrize("field", ["edit", "stem_edit"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_edit_is_refused_with_a_400_naming_it(field, path):
    body = json.dumps({"model": "m", "prompt": "x", field: {"source": "a", "target": "b"}}).encode()
    received, sent = call(path, body)
    assert received is None
    assert sent[0]["status"] == 400
    error = json.loads(sent[1]["body"])["error"]
    assert error["code"] == 400 and f"per-request edits ({field}) are not supported by vLLM" in error["message"]


@pytest.mark.parametrize("chunks", [1, 2])
def test_a_request_without_an_edit_reaches_the_app_whole(chunks):
    body = json.dumps({"model": "m", "prompt": "the edit of a text is fine", "max_tokens": 3}).encode()
    received, sent = call("/v1/completions", body, chunks=chunks)
    assert received == body and sent[0]["status"] == 200


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b""])
def test_a_body_that_is_not_a_json_object_is_left_to_the_app(body):
    received, _ = call("/v1/completions", body)
    assert received == body


def test_other_paths_and_methods_pass_untouched():
    body = json.dumps({"edit": {}}).encode()
    assert call("/v1/embeddings", body)[0] == body
    assert call("/v1/completions", body, method="GET")[0] == body
