"""A bounded loopback load test of the OpenAI-compatible server: 64 concurrent streaming clients for 15 seconds
against 16 batch slots (so the queue is used too); no errors, every greedy output equal to single-stream
`generate`, no slot or queued request left behind, and the batch really ran more than one request per step."""

from __future__ import annotations

import threading
import time

from tests.serve.openai_helpers import MODEL, serving

CLIENTS, SLOTS, SECONDS = 64, 16, 15.0
PROMPTS = ["The capital of France is", "Water boils at", "In 1905 Einstein", "A list of colours: red,"]


def test_sixty_four_concurrent_streams(chat_ckpt, reference):
    expected = {(p, n): reference(p, n) for p in PROMPTS for n in (6, 11)}
    errors, done = [], []
    with serving(chat_ckpt, slots=SLOTS, max_queue=CLIENTS) as (server, client):
        stop_at = time.monotonic() + SECONDS

        def worker(k: int) -> None:
            i = k
            while time.monotonic() < stop_at and not errors:
                prompt, n = PROMPTS[i % len(PROMPTS)], (6, 11)[i % 2]
                i += CLIENTS
                try:
                    stream = client.completions.create(
                        model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True
                    )
                    text = "".join(c.choices[0].text for c in stream)
                except Exception as exc:  # any client error fails the test below, with its message
                    errors.append(f"{type(exc).__name__}: {exc}")
                    return
                if text != expected[(prompt, n)]:
                    errors.append(f"{prompt!r}, {n} tokens: {text!r} != {expected[(prompt, n)]!r}")
                done.append(n)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        engine = server.service.engine
        server.service.loop.stop()  # joins the loop: a request the client saw finish may still be leaving its row
        assert not errors, errors[:3]
        assert not any(t.is_alive() for t in threads)
        assert not engine.active and not engine.waiting
        assert len(done) >= CLIENTS
        assert engine.tokens > engine.steps + len(done)  # decode steps carried several requests each
