"""Helpers of the OpenAI-compatible server tests: a checkpoint with a chat template, single-stream references,
a server on a free loopback port with an `openai` client, and raw stdlib requests."""

from __future__ import annotations

import http.client
import json
from contextlib import contextmanager
from urllib.parse import urlsplit

from stemlm.checkpoint.runs import load_checkpoint
from stemlm.inference.generate import generate
from stemlm.serve.editing import EditSpec
from stemlm.serve.playground import Playground
from stemlm.serve.served_model import EOT_TOKEN, edit_rows
from tests.serve.conftest import write_checkpoint

TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MODEL = "tiny-stem"


def write_chat_checkpoint(folder):
    write_checkpoint(folder)
    config = {"chat_template": TEMPLATE, "eos_token": EOT_TOKEN}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def single_stream(folder):
    """`greedy(prompt, max_tokens, edit=None) -> text`: single-stream `generate` on the checkpoint loaded apart
    from the server, the edit (an `EditSpec`) applied at prefill as the server applies it."""
    model, tok = load_checkpoint(folder)
    eot = tok.token_to_id(EOT_TOKEN)

    def greedy(prompt, max_tokens: int, edit: EditSpec | None = None) -> str:
        ids = prompt if isinstance(prompt, list) else tok.encode(prompt, add_special_tokens=False).ids
        rows = None if edit is None else edit_rows(model, tok, ids, edit)
        return tok.decode(generate(model, ids, max_tokens, greedy=True, eos_id=eot, prefill_rows=rows))

    return greedy


def http_request(url: str, method: str, path: str, body=None, headers=None) -> http.client.HTTPResponse:
    """A raw request (stdlib), for what the openai client cannot send: another Host header, a dropped stream."""
    return open_request(url, method, path, body, headers)[1]


def open_request(url: str, method: str, path: str, body=None, headers=None, *, wait: bool = True):
    """(connection, response) of a raw request; `wait=False` sends it without reading the response (None);
    `connection.close()` then drops the client's socket."""
    conn = http.client.HTTPConnection(urlsplit(url).netloc, timeout=30)
    data = None if body is None else json.dumps(body)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    return conn, conn.getresponse() if wait else None


@contextmanager
def serving(folder, options=None, graceful_timeout: float = 5.0, **settings):
    """`with serving(ckpt, **ServedModel settings) as (server, client):` a live server and an openai client."""
    import openai

    from stemlm.serve.server import Server

    pg = Playground.load(folder, options, name=MODEL, **{"slots": 4, **settings})
    with Server(pg, port=0, graceful_timeout=graceful_timeout).running() as server:
        yield server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
