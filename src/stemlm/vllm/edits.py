"""`RefuseEdits`: an ASGI middleware that answers 400 to a completion or chat request carrying stemlm's `edit`.

    vllm serve CKPT --middleware stemlm.vllm.edits.RefuseEdits

stemlm's own server takes a per-request positional edit (`edit`, old name `stem_edit`): the STEM rows of some
positions of this one request are swapped for other tokens' rows. vLLM's engine runs the tokens of many requests as
one flat batch through a model that is told nothing per request beyond positions and the KV cache, so the model
cannot tell which rows to swap for whom; and vLLM's OpenAI server accepts unknown fields and ignores them (a log
line), which would answer the unedited completion as if it were the edited one. This middleware makes that a
clear error instead. A global edit is a different checkpoint (`stemlm edit CKPT ... --save OUT`): serve that folder.
"""

from __future__ import annotations

import json

EDIT_FIELDS = ("edit", "stem_edit")
PATHS = ("/v1/completions", "/v1/chat/completions")
MESSAGE = (
    "per-request edits ({field}) are not supported by vLLM: its batched model step has no per-request row swap. "
    "Serve an edited checkpoint (stemlm edit CKPT ... --save OUT) or use stemlm serve for per-request edits"
)


class RefuseEdits:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in PATHS:
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        field = edit_field(body)
        if field is not None:
            await refuse(send, MESSAGE.format(field=field))
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # the client's disconnect, as the app would have seen it
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def edit_field(body: bytes) -> str | None:
    """The edit field a JSON request body names, if any (a body that is not JSON is left to vLLM to refuse)."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(request, dict):
        return None
    return next((name for name in EDIT_FIELDS if name in request), None)


async def refuse(send, message: str) -> None:
    payload = json.dumps({"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}})
    await send({"type": "http.response.start", "status": 400, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": payload.encode()})
