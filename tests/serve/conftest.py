"""Fixtures for the playground tests: tiny random checkpoints with the default tokenizer, apps and live servers.

`stem_ckpt` is a random STEM model (vocab 8192, the shipped tokenizer's size) whose weights are drawn large
enough (initializer_range 0.3, table rows N(0, 1)) that the next-token distribution is peaked and an entity
swap visibly moves it: with seed 0, editing " France" -> " Germany" (3 tokens) in PROMPT with the `average`
strategy changes the greedy first token.
`dense_ckpt` is its dense twin (no tables: editing must refuse). `live_server(ckpt, **load)` starts the
real threaded WSGI server on a free loopback port and yields its base URL. `chat_ckpt` (with a chat template)
and `reference` (its single-stream greedy text) serve the OpenAI-compatible server's tests
(`tests/serve/openai_helpers.py`).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest
from werkzeug.serving import make_server

from stemlm.checkpoint.folder import save_pretrained
from stemlm.data.tokenizer import default_tokenizer
from stemlm.model import build_model
from stemlm.model.config import ModelConfig
from stemlm.serve import Playground, create_app

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
        stem_layers="all-but-first",
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


@pytest.fixture
def client_for():
    """Factory: `client_for(ckpt, **Playground.load kwargs) -> (flask test client, playground)`."""
    made = []

    def make(ckpt, **kwargs):
        pg = Playground.load(ckpt, **kwargs)
        made.append(pg)
        return create_app(pg).test_client(), pg

    yield make
    for pg in made:
        pg.close()


@contextmanager
def running_server(pg: Playground):
    server = make_server("127.0.0.1", 0, create_app(pg), threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


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
