"""Fixtures for the playground tests: tiny random checkpoints with the default tokenizer, apps and live servers.

`stem_ckpt` is a random STEM model (vocab 8192, the shipped tokenizer's size) whose weights are drawn large
enough (initializer_range 0.3, table rows N(0, 1)) that the next-token distribution is peaked and an entity
swap visibly moves it: with seed 0, editing " France" -> " Germany" (3 tokens) in PROMPT with the `average`
strategy changes the greedy first token.
`dense_ckpt` is its dense twin (no tables: editing must refuse). `client_for(ckpt, **load)` starts the server
(`stemlm serve`'s app under uvicorn) on a free loopback port and returns a small HTTP client of it;
`live_server(ckpt, **load)` yields its base URL. `chat_ckpt` (with a chat template)
and `reference` (its single-stream greedy text) serve the OpenAI-compatible server's tests
(`tests/serve/openai_helpers.py`).
"""

from __future__ import annotations

import http.client
from contextlib import ExitStack, contextmanager
from json import dumps, loads
from urllib.parse import urlsplit

import pytest

from stemlm.checkpoint.folder import save_pretrained
from stemlm.data.tokenizer import default_tokenizer
from stemlm.model import build_model
from stemlm.model.config import ModelConfig
from stemlm.serve import Playground
from stemlm.serve.server import Server

PROMPT = "The capital of France is"
SOURCE, TARGET = "France", "Germany"


def serve_config(ffn: str = "stem") -> ModelConfig:
    return ModelConfig(
        vocab_size=8192,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        ffn=ffn,
        ffn_layers="all-but-first",
        initializer_range=0.3,
        table_init="normal",
        table_init_std=1.0,
    )


def write_checkpoint(path, ffn: str = "stem", seed: int = 0):
    save_pretrained(build_model(serve_config(ffn), seed=seed).eval(), path, tokenizer=default_tokenizer())
    return path


@pytest.fixture(scope="session")
def stem_ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("serve") / "stem")


@pytest.fixture(scope="session")
def dense_ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("serve") / "dense", ffn="dense")


class Reply:
    """A finished HTTP response, read whole."""

    def __init__(self, status: int, headers, data: bytes) -> None:
        self.status_code, self.headers, self.data = status, headers, data

    @property
    def mimetype(self) -> str:
        return self.headers.get("Content-Type", "").split(";")[0].strip()

    def get_json(self):
        return loads(self.data)

    def get_data(self, as_text: bool = False):
        return self.data.decode() if as_text else self.data


class Client:
    """A web client for the tests, on a live server: `get(path)`, `post(path, json=...)` or
    `post(path, data=..., content_type=...)`, each returning a `Reply`."""

    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, headers: dict | None = None) -> Reply:
        return self._request("GET", path, None, headers or {})

    def post(self, path, json=None, data=None, content_type=None, headers=None) -> Reply:
        headers = dict(headers or {})
        if json is not None:
            data, content_type = dumps(json), "application/json"
        if content_type is not None:
            headers["Content-Type"] = content_type
        return self._request("POST", path, data, headers)

    def _request(self, method: str, path: str, body, headers: dict) -> Reply:
        conn = http.client.HTTPConnection(urlsplit(self.url).netloc, timeout=120)
        try:
            try:
                conn.request(method, path, body=body.encode() if isinstance(body, str) else body, headers=headers)
            except (BrokenPipeError, ConnectionResetError):  # answered (413) and closed before the upload ended
                pass
            response = conn.getresponse()
            return Reply(response.status, response.headers, response.read())
        finally:
            conn.close()


@contextmanager
def running_server(pg: Playground, hosts=()):
    """The server's app on a free loopback port for the block (`hosts`: --allow-host names); its base URL."""
    with Server(pg, port=0, allow_hosts=hosts, graceful_timeout=5.0).running() as server:
        yield server.url


@pytest.fixture
def client_for():
    """Factory: `client_for(ckpt, hosts=(), **Playground.load kwargs) -> (client of a live server, playground)`."""
    with ExitStack() as stack:

        def make(ckpt, hosts=(), **kwargs):
            pg = Playground.load(ckpt, **kwargs)
            stack.callback(pg.close)
            return Client(stack.enter_context(running_server(pg, hosts))), pg

        yield make


@pytest.fixture
def live_server():
    """Factory context manager: `with live_server(ckpt, **load kwargs) as (url, playground):`."""

    @contextmanager
    def start(ckpt, **kwargs):
        pg = Playground.load(ckpt, **kwargs)
        try:
            with running_server(pg) as url:
                yield url, pg
        finally:
            pg.close()

    return start


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    """A `stem_ckpt` twin with a chat template, for the OpenAI-compatible server."""
    from tests.serve.openai_helpers import write_chat_checkpoint

    return write_chat_checkpoint(tmp_path_factory.mktemp("openai") / "stem")


@pytest.fixture(scope="module")
def reference(chat_ckpt):
    """Single-stream greedy text of `chat_ckpt`: `reference(prompt, max_tokens, edit=None)`."""
    from tests.serve.openai_helpers import single_stream

    return single_stream(chat_ckpt)
