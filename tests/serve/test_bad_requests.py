"""Bad requests to both servers are a 400 (or 413) naming the problem, never a 500: numbers that are NaN, Infinity,
1e400, booleans or strings; texts with a lone surrogate; JSON too deep or integers too long to read; bodies over
1 MiB, announced or chunked; Host headers spelled as IPv6 or IPv4-mapped literals of a foreign address."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import pytest

from stemlm.serve.hosts import host_allowed, normal_host, trusted_hosts
from tests.serve.conftest import PROMPT
from tests.serve.openai_helpers import MODEL, serving

BIG = 3 << 20  # bytes: three times the servers' limit


def raw_body(fields: dict[str, str]) -> str:
    """A JSON object whose values are given as raw JSON text (so NaN, 1e400 and long integers go out as typed)."""
    return "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in fields.items()) + "}"


def post_chunked(url: str, path: str, size: int, host: str | None = None) -> int:
    """POST `size` bytes with Transfer-Encoding: chunked (no Content-Length); the status code."""
    conn = http.client.HTTPConnection(urlsplit(url).netloc, timeout=60)
    chunk = b'{"prompt": "' + b"a" * (64 * 1024)

    def chunks():
        sent = 0
        while sent < size:
            yield chunk
            sent += len(chunk)

    headers = {"Content-Type": "application/json", **({"Host": host} if host else {})}
    try:
        conn.request("POST", path, body=chunks(), headers=headers, encode_chunked=True)
    except (BrokenPipeError, ConnectionResetError):  # the server answered and closed before the upload ended
        pass
    status = conn.getresponse().status
    conn.close()
    return status


# ----- the playground -----
NUMBER_CASES = [
    (field, value)
    for field in ("max_new_tokens", "seed", "top_k")
    for value in ("NaN", "Infinity", "-Infinity", "1e400", "true", '"5"', "2.5", "1" + "0" * 30)
] + [(field, value) for field in ("temperature", "top_p") for value in ("NaN", "Infinity", "1e400", "true", '"1"')]


@pytest.mark.parametrize("field, value", NUMBER_CASES)
def test_playground_numbers_are_strict(client_for, stem_ckpt, field, value):
    client, _ = client_for(stem_ckpt)
    reply = client.post("/api/generate", data=raw_body({"prompt": json.dumps(PROMPT), field: value}),
                        content_type="application/json")  # fmt: skip
    assert reply.status_code == 400, reply.get_data(as_text=True)
    message = reply.get_json()["error"]
    assert message.startswith(field) and "\n" not in message and len(message) < 200


def test_playground_still_takes_integral_numbers(client_for, stem_ckpt):
    client, _ = client_for(stem_ckpt)
    body = raw_body({"prompt": json.dumps(PROMPT), "max_new_tokens": "2.0", "seed": "3", "greedy": "true"})
    reply = client.post("/api/generate", data=body, content_type="application/json")
    assert reply.status_code == 200 and "event: done" in reply.get_data(as_text=True)


@pytest.mark.parametrize("route, field", [("/api/tokenize", "prompt"), ("/api/generate", "prompt"),
                                          ("/api/edit", "target")])  # fmt: skip
def test_playground_lone_surrogate_is_a_400(client_for, stem_ckpt, route, field):
    client, _ = client_for(stem_ckpt)
    body = {"prompt": PROMPT, "target": "Germany", "source": "France", field: "Paris \ud800 x"}
    reply = client.post(route, data=json.dumps(body), content_type="application/json")
    assert reply.status_code == 400 and reply.get_json()["error"].startswith(f"{field} holds a lone surrogate")


@pytest.mark.parametrize(
    "data, message",
    [
        (raw_body({"prompt": json.dumps(PROMPT), "seed": "9" * 5000}), "integer too long"),
        ('{"prompt": ', "not valid JSON"),
        (b"\xff\xfe{}", "not UTF-8"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ],
)
def test_playground_unreadable_bodies(client_for, stem_ckpt, data, message):
    client, _ = client_for(stem_ckpt)
    reply = client.post("/api/generate", data=data, content_type="application/json")
    assert reply.status_code == 400 and message in reply.get_json()["error"]


def test_playground_large_bodies_are_413(live_server, stem_ckpt, client_for):
    client, _ = client_for(stem_ckpt)
    announced = client.post("/api/tokenize", data=b" " * BIG, content_type="application/json")
    assert announced.status_code == 413 and "error" in announced.get_json()
    with live_server(stem_ckpt) as (url, _):
        assert post_chunked(url, "/api/tokenize", BIG) == 413
        assert post_chunked(url, "/api/tokenize", 1024) == 400  # small and chunked: read, then refused as JSON


@pytest.mark.parametrize(
    "host, status",
    [
        ("[::ffff:203.0.113.9]", 400),
        ("[::ffff:203.0.113.9]:7860", 400),
        ("[::ffff:cb00:7109]", 400),
        ("[fe80::1]", 400),
        ("[::ffff:127.0.0.1]:7860", 200),
        ("[0:0:0:0:0:0:0:1]:7860", 200),
        ("LOCALHOST:7860", 200),
        ("", 400),
    ],
)
def test_playground_host_check_reads_addresses(client_for, stem_ckpt, host, status):
    client, _ = client_for(stem_ckpt)
    assert client.get("/api/info", headers={"Host": host}).status_code == status


def test_host_normalisation():
    assert normal_host("[::FFFF:203.0.113.9]") == "203.0.113.9"
    assert normal_host("[0::1]") == "[::1]" and normal_host("Example.COM") == "example.com"
    bound = trusted_hosts("203.0.113.9")
    assert host_allowed("[::ffff:203.0.113.9]:80", bound) and not host_allowed("203.0.113.10", bound)
    assert host_allowed("[2001:db8::1]", trusted_hosts("2001:db8:0::1"))


# ----- the OpenAI-compatible server -----
@pytest.fixture(scope="module")
def api_url(chat_ckpt):
    with serving(chat_ckpt) as (server, _):
        yield server.url


def api_post(url: str, path: str, data: str | bytes, host: str | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(urlsplit(url).netloc, timeout=60)
    headers = {"Content-Type": "application/json", **({"Host": host} if host else {})}
    conn.request("POST", path, body=data, headers=headers)
    reply = conn.getresponse()
    status, payload = reply.status, json.loads(reply.read() or b"{}")
    conn.close()
    return status, payload


OPENAI_CASES = [
    (field, value)
    for field in ("max_tokens", "seed", "logprobs")
    for value in ("NaN", "Infinity", "1e400", "true", '"5"', "2.0", "-1")
] + [(field, value) for field in ("temperature", "top_p") for value in ("NaN", "-Infinity", "1e400", "false", '"1"')]


@pytest.mark.parametrize("field, value", OPENAI_CASES)
def test_openai_numbers_are_strict(api_url, field, value):
    body = raw_body({"model": json.dumps(MODEL), "prompt": json.dumps(PROMPT), field: value})
    status, payload = api_post(api_url, "/v1/completions", body)
    message = payload["error"]["message"]
    assert status == 400 and message.startswith(field) and "\n" not in message, payload


@pytest.mark.parametrize(
    "body, message",
    [
        ({"model": MODEL, "prompt": "a \udfff b"}, "prompt holds a lone surrogate"),
        ({"model": MODEL, "prompt": PROMPT, "stop": ["\ud800"]}, "stop holds a lone surrogate"),
        (
            {"model": MODEL, "prompt": PROMPT, "edit": {"source": "France", "target": "G\ud800"}},
            "edit.target",
        ),
        (  # the old name, in the messages too
            {"model": MODEL, "prompt": PROMPT, "stem_edit": {"source": "France", "target": "G\ud800"}},
            "stem_edit.target",
        ),
        (
            {"model": MODEL, "prompt": PROMPT, "edit": {"source": "France", "target": "Germany"}, "stem_edit": {}},
            "give the edit once",
        ),
        ({"model": MODEL, "prompt": PROMPT, "max_tokens": 10**45}, "a 46-digit number"),
    ],
)
def test_openai_bad_texts(api_url, body, message):
    status, payload = api_post(api_url, "/v1/completions", json.dumps(body))
    assert status == 400 and message in payload["error"]["message"]


def test_openai_chat_message_with_a_lone_surrogate(api_url):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi \ud800"}]}
    status, payload = api_post(api_url, "/v1/chat/completions", json.dumps(body))
    assert status == 400 and payload["error"]["message"].startswith("messages[0].content holds a lone surrogate")


@pytest.mark.parametrize(
    "data, message",
    [
        (raw_body({"model": json.dumps(MODEL), "prompt": json.dumps(PROMPT), "seed": "7" * 5000}), "integer too long"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        (b"\xc3\x28", "not UTF-8"),
    ],
)
def test_openai_unreadable_bodies(api_url, data, message):
    status, payload = api_post(api_url, "/v1/completions", data)
    assert status == 400 and message in payload["error"]["message"]


def test_openai_large_bodies_are_413(api_url):
    status, payload = api_post(api_url, "/v1/completions", b" " * BIG)
    assert status == 413 and "at most" in payload["error"]["message"]
    assert post_chunked(api_url, "/v1/completions", BIG) == 413


@pytest.mark.parametrize("host, status", [("[::ffff:203.0.113.9]:8000", 400), ("[::ffff:127.0.0.1]:8000", 200)])
def test_openai_host_check_reads_addresses(api_url, host, status):
    conn = http.client.HTTPConnection(urlsplit(api_url).netloc, timeout=60)
    conn.request("GET", "/v1/models", headers={"Host": host})
    assert conn.getresponse().status == status
    conn.close()


def test_openai_edit_and_its_old_name_parse_alike():
    from stemlm.serve.openai_params import parse_completion

    edit = {"source": "France", "target": "Germany", "rows": "tables", "layers": [1]}
    new = parse_completion({"model": MODEL, "prompt": PROMPT, "edit": edit}, context=64)
    old = parse_completion({"model": MODEL, "prompt": PROMPT, "stem_edit": edit}, context=64)
    assert new.edit == old.edit and new.edit is not None
