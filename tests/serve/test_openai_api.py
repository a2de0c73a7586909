"""The OpenAI-compatible server driven by the real `openai` client on a free loopback port: completions, chat,
streaming, stop sequences, logprobs, an edit request beside an unedited one, strict errors, 429, timeouts,
the Host check and /metrics. Every greedy output is compared with single-stream `generate` on the same
checkpoint loaded separately."""

from __future__ import annotations

import threading
import time

import pytest

from stemlm.inference.load import InferenceOptions
from stemlm.serve.editing import EditSpec
from tests.serve.conftest import PROMPT, SOURCE, TARGET
from tests.serve.openai_helpers import MODEL, http_request, open_request, serving

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def api(chat_ckpt):
    with serving(chat_ckpt) as running:
        yield running


def test_models(api):
    _, client = api
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_equals_single_stream(api, reference):
    _, client = api
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text == reference(PROMPT, 12)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 12


def test_streamed_completion_concatenates_to_the_same_text(api, reference):
    _, client = api
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == reference(PROMPT, 12)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_uses_the_checkpoint_template(api, reference, chat_ckpt):
    _, client = api
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a capital."}]
    rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    expected = reference(rendered + "<|im_start|>assistant\n", 10)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert out.choices[0].message.content == expected and out.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected


def test_stop_sequence_cuts_the_text(api, reference):
    _, client = api
    full = reference(PROMPT, 16)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected = full[: full.index(stop)]
    for stream in (False, True):
        out = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop], stream=stream
        )
        chunks = list(out) if stream else [out]
        assert "".join(c.choices[0].text for c in chunks) == expected
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs(api):
    _, client = api
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 3 and "".join(lp.tokens) == out.choices[0].text
    pairs = zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    assert all(max(top.values()) == pytest.approx(chosen) for top, chosen in pairs)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0, logprobs=True,
        top_logprobs=3,
    )  # fmt: skip
    assert [len(t.top_logprobs) for t in chat.choices[0].logprobs.content] == [3, 3]


def test_edit_applies_to_its_request_only(api, reference):
    _, client = api
    edit = {"source": SOURCE, "target": TARGET, "strategy": "average"}
    expected_edit = reference(PROMPT, 10, EditSpec(target=TARGET, source=SOURCE, strategy="average"))
    expected_plain = reference(PROMPT, 10)
    assert expected_edit != expected_plain
    results = {}

    def ask(name, extra):
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, extra_body=extra)
        results[name] = out.choices[0].text

    threads = [threading.Thread(target=ask, args=(n, e)) for n, e in (("edit", {"edit": edit}), ("plain", {}))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {"edit": expected_edit, "plain": expected_plain}


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"frobnicate": 1}, "unknown field 'frobnicate'"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"edit": {"source": "Mars", "target": TARGET}}, "Mars"),
        ({"n": 0}, "n must be between 1 and 16"),
        ({"n": 17}, "n must be between 1 and 16"),
        ({"n": 2, "prompt": [PROMPT] * 40}, "asks for 80 completions (40 prompts x n=2)"),
        ({"prompt": []}, "prompt is an empty list"),
        ({"prompt": [PROMPT, 3]}, "prompt[1] must be a string or a non-empty list of token ids"),
        ({"prompt": [PROMPT, []]}, "prompt[1] must be a string or a non-empty list of token ids"),
        ({"prompt": list(range(300))}, "reads at most 127"),
        ({"prompt": [PROMPT, list(range(300))]}, "prompt[1]: the prompt has 300 tokens; this model reads at most 127"),
        ({"max_tokens": 0}, "max_tokens must be between 1 and 128"),
        ({"echo": True, "max_tokens": -1}, "max_tokens must be between 0 and 128"),
        ({"echo": True, "logprobs": 6}, "logprobs must be between 0 and 5"),
        ({"echo": True, "stream": True}, "echo is not supported with stream"),
    ],
)
def test_bad_requests_are_400_with_one_line(api, extra, message):
    _, client = api
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body=extra)
    text = info.value.body["message"]
    assert message in text and "\n" not in text


def test_unknown_model_host_check_and_metrics(api):
    server, client = api
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt=PROMPT, max_tokens=2)
    assert http_request(server.url, "GET", "/v1/models", headers={"Host": "evil.example"}).status == 400
    text = http_request(server.url, "GET", "/metrics").read().decode()
    for name in ("stemlm_requests_total", "stemlm_queue_length", "stemlm_time_to_first_token_seconds_bucket"):
        assert name in text


def metric(url: str, name: str) -> float:
    lines = http_request(url, "GET", "/metrics").read().decode().splitlines()
    return next(float(line.split()[-1]) for line in lines if line.startswith(name + " "))


def test_metrics_count_queue_wait_and_first_token_per_sequence(api):
    server, client = api
    names = ("stemlm_queue_wait_seconds_count", "stemlm_time_to_first_token_seconds_count")
    before = [metric(server.url, name) for name in names]
    client.completions.create(model=MODEL, prompt=[PROMPT, PROMPT + " and", "Hello"], max_tokens=3, temperature=0)
    after = [metric(server.url, name) for name in names]
    assert [a - b for a, b in zip(after, before, strict=True)] == [3, 3]  # each prompt of the request once
    assert metric(server.url, "stemlm_queue_wait_seconds_sum") >= 0


def test_queue_full_is_429_and_timeout_is_504(chat_ckpt):
    with serving(chat_ckpt, max_queue=0) as (_, client):
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    with serving(chat_ckpt, request_timeout=1e-6) as (server, client):
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=50)
        assert info.value.status_code == 504
        server.service.loop.stop()  # the cancelled request leaves its slot at the next step
        assert not server.service.engine.active


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_cancels_the_request(chat_ckpt, stream):
    with serving(chat_ckpt) as (server, _):
        engine, submitted = server.service.engine, []
        step, submit = engine.step, server.service.loop.submit
        engine.step = lambda: (time.sleep(0.02), step())[1]  # slow decoding: 100 tokens take over 2 s
        server.service.loop.submit = lambda request: submitted.append(request) or submit(request)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 100, "stream": stream}
        conn, response = open_request(server.url, "POST", "/v1/completions", body, wait=stream)
        if stream:
            assert response.readline().startswith(b"data: ")
        else:
            time.sleep(0.3)  # the request is decoding
        conn.close()  # the client goes away mid-request
        assert submitted[0].done.wait(10)
        assert submitted[0].finish_reason == "cancelled" and len(submitted[0].output_ids) < 100
        server.service.loop.stop()
        assert not engine.busy


def test_shutdown_cancels_what_outlives_the_grace_period(chat_ckpt):
    submitted = []
    with serving(chat_ckpt, graceful_timeout=0.5) as (server, _):
        engine, step, submit = server.service.engine, server.service.engine.step, server.service.loop.submit
        engine.step = lambda: (time.sleep(0.05), step())[1]  # 100 tokens would take over 5 s
        server.service.loop.submit = lambda request: submitted.append(request) or submit(request)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 100, "stream": True}
        response = http_request(server.url, "POST", "/v1/completions", body)
        assert response.readline().startswith(b"data: ")
        start = time.monotonic()
    assert time.monotonic() - start < 4  # the grace period, then the cancel; not the whole generation
    assert submitted[0].finish_reason == "cancelled" and not engine.busy


def test_host_tables_serve_the_same_text(chat_ckpt, reference):
    with serving(chat_ckpt, InferenceOptions(tables="host", cache_rows=64)) as (server, client):
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
        edited = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
            extra_body={"stem_edit": {"source": SOURCE, "target": TARGET, "strategy": "average"}},  # edit's old name
        )  # fmt: skip
        metrics = http_request(server.url, "GET", "/metrics").read().decode()
    assert out.choices[0].text == reference(PROMPT, 10)
    assert edited.choices[0].text == reference(PROMPT, 10, EditSpec(target=TARGET, source=SOURCE, strategy="average"))
    assert 'stemlm_row_cache_hit_rate{family="token"}' in metrics
