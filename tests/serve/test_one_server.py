"""`stemlm serve` is one server: the playground page's generation and an OpenAI client's completion are requests of
the same batch engine on the same loaded model, and give the same greedy text as single-stream `generate`."""

from __future__ import annotations

import json
import threading

import pytest

from tests.serve.conftest import PROMPT, Client
from tests.serve.openai_helpers import MODEL, serving

pytest.importorskip("openai")


def test_the_page_and_the_api_decode_in_one_engine(chat_ckpt, reference):
    with serving(chat_ckpt) as (server, client):
        engine, answers = server.service.engine, {}

        def page():
            body = {"prompt": PROMPT, "max_new_tokens": 8, "greedy": True}
            reply = Client(server.url).post("/api/generate", json=body).get_data(as_text=True)
            answers["page"] = json.loads(reply.rsplit("event: done\ndata: ", 1)[1])

        thread = threading.Thread(target=page)
        thread.start()
        answers["api"] = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
        thread.join()
        expected = reference(PROMPT, 8)
        assert answers["api"].choices[0].text == expected
        assert answers["page"]["completion"] == expected and answers["page"]["num_tokens"] == 8
        assert engine.tokens == 16 and not engine.active  # both requests' tokens, sampled by the one engine
