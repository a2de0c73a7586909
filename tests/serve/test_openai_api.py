"""The OpenAI-compatible server driven by the real `openai` client on a free loopback port: completions, chat,
streaming, stop sequences, logprobs, an edit request beside an unedited one, strict errors, 429, timeouts,
the Host check and /metrics. Every greedy output is compared with single-stream `generate` on the same
checkpoint loaded separately."""

from __future__ import annotations

import http.client
import json
import threading
from contextlib import contextmanager
from urllib.parse import urlsplit

import pytest

from stemlm.checkpoint.runs import load_checkpoint
from stemlm.inference.generate import generate
from stemlm.inference.load import InferenceOptions
from stemlm.serve.editing import EditSpec
from stemlm.serve.openai_run import ApiServer
from stemlm.serve.openai_service import EOT_TOKEN, ApiService, edit_prefill_hooks
from tests.serve.conftest import PROMPT, SOURCE, TARGET, write_checkpoint

openai = pytest.importorskip("openai")

TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MODEL = "tiny-stem"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = write_checkpoint(tmp_path_factory.mktemp("openai") / "stem")
    config = {"chat_template": TEMPLATE, "eos_token": EOT_TOKEN}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def reference(ckpt):
    """Single-stream greedy text of a prompt (ids or text), optionally with a positional edit at prefill."""
    model, tok = load_checkpoint(ckpt)
    eot = tok.token_to_id(EOT_TOKEN)

    def greedy(prompt, max_tokens: int, edit: EditSpec | None = None) -> str:
        ids = prompt if isinstance(prompt, list) else tok.encode(prompt, add_special_tokens=False).ids
        hooks = {} if edit is None else edit_prefill_hooks(model, tok, ids, edit)
        rows = dict(prefill_table_rows=hooks.get("table_rows"), prefill_embed_rows=hooks.get("embed_rows"))
        return tok.decode(generate(model, ids, max_tokens, greedy=True, eos_id=eot, **rows))

    return greedy


def http_request(url: str, method: str, path: str, body=None, headers=None) -> http.client.HTTPResponse:
    """A raw request (stdlib), for what the openai client cannot send: another Host header, a dropped stream."""
    conn = http.client.HTTPConnection(urlsplit(url).netloc, timeout=30)
    data = None if body is None else json.dumps(body)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    return conn.getresponse()


@contextmanager
def serving(ckpt, options=None, **settings):
    service = ApiService.load(ckpt, options, name=MODEL, **{"slots": 4, **settings})
    with ApiServer(service, port=0, graceful_timeout=5).running() as server:
        yield server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def api(ckpt):
    with serving(ckpt) as running:
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


def test_chat_uses_the_checkpoint_template(api, reference, ckpt):
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

    threads = [threading.Thread(target=ask, args=(n, e)) for n, e in (("edit", {"stem_edit": edit}), ("plain", {}))]
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
        ({"stem_edit": {"source": "Mars", "target": TARGET}}, "Mars"),
        ({"n": 2}, "n must be 1"),
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


def test_queue_full_is_429_and_timeout_is_504(ckpt):
    with serving(ckpt, max_queue=0) as (_, client):
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    with serving(ckpt, request_timeout=1e-6) as (server, client):
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=50)
        assert info.value.status_code == 504
        server.service.loop.stop()  # the cancelled request leaves its slot at the next step
        assert not server.service.engine.active


def test_disconnect_frees_the_slot(api):
    server, _ = api
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 100, "stream": True}
    response = http_request(server.url, "POST", "/v1/completions", body)
    assert response.readline().startswith(b"data: ")
    response.close()  # the client goes away mid-stream
    engine = server.service.engine
    for _ in range(200):
        if not engine.busy:
            break
        threading.Event().wait(0.05)
    assert not engine.busy


def test_host_tables_serve_the_same_text(ckpt, reference):
    with serving(ckpt, InferenceOptions(tables="host", cache_rows=64)) as (server, client):
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
        edited = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
            extra_body={"stem_edit": {"source": SOURCE, "target": TARGET, "strategy": "average"}},
        )  # fmt: skip
        metrics = http_request(server.url, "GET", "/metrics").read().decode()
    assert out.choices[0].text == reference(PROMPT, 10)
    assert edited.choices[0].text == reference(PROMPT, 10, EditSpec(target=TARGET, source=SOURCE, strategy="average"))
    assert 'stemlm_row_cache_hit_rate{family="token"}' in metrics
