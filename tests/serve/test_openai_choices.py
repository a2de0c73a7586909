"""What real clients send to vLLM's /v1/completions, on `stemlm serve` with the `openai` client: a list of prompts
(texts and token ids) and `n` (choices prompt-major, greedy choices equal, seeded ones distinct, usage summed,
streamed too), `echo` with `logprobs` and `max_tokens: 0` for scoring a prompt (lm-eval's `local-completions`), and
a run folder served under the run's name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from stemlm.checkpoint.runs import load_checkpoint
from stemlm.serve.playground import Playground
from stemlm.serve.server import Server
from tests.serve.conftest import PROMPT
from tests.serve.openai_helpers import MODEL, http_request, serving

openai = pytest.importorskip("openai")
OTHER = "The language of Spain is"


@pytest.fixture(scope="module")
def api(chat_ckpt):
    with serving(chat_ckpt) as running:
        yield running


@pytest.fixture(scope="module")
def scored(chat_ckpt):
    """`scored(ids) -> (log p of each token after the first, top-2 ids at each position)`: one plain forward on
    the checkpoint loaded apart from the server."""
    model, _ = load_checkpoint(chat_ckpt)

    def score(ids):
        with torch.no_grad():
            logp = model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
        return logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist(), torch.topk(logp, 2).indices.tolist()

    return score


def test_prompts_and_n_are_prompt_major_greedy_choices_equal(api, reference, chat_ckpt):
    _, client = api
    ids = load_checkpoint(chat_ckpt)[1].encode(OTHER, add_special_tokens=False).ids
    out = client.completions.create(model=MODEL, prompt=[PROMPT, ids], n=2, max_tokens=6, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [reference(PROMPT, 6)] * 2 + [reference(ids, 6)] * 2
    prompt_tokens = len(ids) + len(load_checkpoint(chat_ckpt)[1].encode(PROMPT, add_special_tokens=False).ids)
    assert out.usage.prompt_tokens == prompt_tokens and out.usage.completion_tokens == 4 * 6


def test_seeded_choices_differ_and_repeat(api):
    _, client = api
    ask = lambda n: client.completions.create(model=MODEL, prompt=PROMPT, n=n, max_tokens=8, temperature=1.5, seed=7)
    three = [c.text for c in ask(3).choices]
    assert len(set(three)) == 3  # one generator per choice, seeded seed + j
    assert [c.text for c in ask(3).choices] == three  # and the same again
    assert ask(1).choices[0].text == three[0]  # choice 0 is the n = 1 request's


def test_streamed_prompts_and_n_give_the_same_choices(api):
    _, client = api
    body = dict(model=MODEL, prompt=[PROMPT, OTHER], n=2, max_tokens=5, temperature=0.9, seed=3)
    whole = client.completions.create(**body)
    texts, reasons = {}, {}
    usage = None
    for chunk in client.completions.create(**body, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens == 20


def test_chat_n(api, reference):
    _, client = api
    messages = [{"role": "user", "content": "Hi"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=4, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].message.content == out.choices[1].message.content
    texts = {}
    for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, n=2, max_tokens=4, temperature=0, stream=True
    ):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert texts == {0: out.choices[0].message.content, 1: out.choices[1].message.content}


def test_echo_with_max_tokens_zero_scores_the_prompt(api, chat_ckpt, scored):
    _, client = api
    tok = load_checkpoint(chat_ckpt)[1]
    ids = tok.encode(PROMPT, add_special_tokens=False).ids
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2, temperature=0)
    choice, (logprobs, top) = out.choices[0], scored(ids)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert choice.logprobs.tokens == [tok.decode([i]) for i in ids]
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(logprobs, abs=1e-4)
    assert [list(t) for t in choice.logprobs.top_logprobs[1:]] == [[tok.decode([i]) for i in row] for row in top]
    assert choice.logprobs.text_offset == [len("".join(choice.logprobs.tokens[:k])) for k in range(len(ids))]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 0)
    twice = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2, n=2)
    assert twice.choices[0].logprobs == twice.choices[1].logprobs == choice.logprobs  # scored once, shared


def test_lm_evals_payload_echoes_ids_then_the_generated_token(api, chat_ckpt, scored, reference):
    """lm-eval's loglikelihood request: token-id prompts, echo, logprobs 1, max_tokens 1, temperature 0, a seed."""
    server, _ = api
    tok = load_checkpoint(chat_ckpt)[1]
    prompts = [tok.encode(text, add_special_tokens=False).ids for text in (PROMPT, OTHER)]
    body = {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0, "seed": 1234}
    out = json.loads(http_request(server.url, "POST", "/v1/completions", {"model": None, **body}).read())
    for choice, ids in zip(out["choices"], prompts, strict=True):
        logprobs = choice["logprobs"]
        assert choice["text"] == tok.decode(ids) + reference(ids, 1)
        assert len(logprobs["tokens"]) == len(ids) + 1 and logprobs["tokens"][-1] == reference(ids, 1)
        assert logprobs["token_logprobs"][1:-1] == pytest.approx(scored(ids)[0], abs=1e-4)
        assert all(len(top) == 1 for top in logprobs["top_logprobs"][1:])


def test_echo_without_logprobs_puts_the_prompt_first(api, reference):
    _, client = api
    out = client.completions.create(model=MODEL, prompt=[PROMPT, OTHER], max_tokens=3, echo=True, temperature=0)
    assert [c.text for c in out.choices] == [PROMPT + reference(PROMPT, 3), OTHER + reference(OTHER, 3)]
    assert out.choices[0].logprobs is None


def test_a_run_folder_is_served_under_the_runs_name(chat_ckpt, tmp_path):
    run = tmp_path / "my-run"
    shutil.copytree(chat_ckpt, run / "checkpoints" / "step-000300")
    pg = Playground.load(run, slots=1)
    try:
        with Server(pg, port=0).running() as server:
            models = json.loads(http_request(server.url, "GET", "/v1/models").read())
            body = {"model": "my-run", "prompt": PROMPT, "max_tokens": 1}
            answer = json.loads(http_request(server.url, "POST", "/v1/completions", body).read())
    finally:
        pg.close()
    assert [m["id"] for m in models["data"]] == ["my-run"] and answer["model"] == "my-run"


def test_lm_evals_generate_payload(api, chat_ckpt, reference):
    """lm-eval's generate_until request: batched token-id prompts, stop strings plus the eos text, a seed."""
    server, _ = api
    tok = load_checkpoint(chat_ckpt)[1]
    prompts = [tok.encode(text, add_special_tokens=False).ids for text in (PROMPT, OTHER)]
    stop = ["\n\n", "<|endoftext|>"]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 8, "temperature": 0, "stop": stop, "seed": 1234}
    out = json.loads(http_request(server.url, "POST", "/v1/completions", body).read())
    expected = [min((reference(ids, 8).split(s)[0] for s in stop), key=len) for ids in prompts]
    assert [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])] == expected
