"""Scoring a prompt (`SamplingParams.prompt_logprobs`, `Request.score_prompt`): the prefill's own logits give each
prompt token's log-probability and top-k, equal to a plain forward's log-softmax, in chunks or whole, single-stream
or batched; `max_tokens=0` scores without generating, and the tokens generated after it are unchanged."""

from __future__ import annotations

import pytest
import torch

from stemlm.errors import StemlmError
from stemlm.inference.batching import BatchEngine
from stemlm.inference.engine import Engine
from stemlm.inference.requests import Request
from stemlm.inference.sampling import SamplingParams
from tests.conftest import make_tiny_model

PROMPT = [5, 17, 3, 42, 8, 11, 29]


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("stem", initializer_range=0.1, max_position_embeddings=40)


def expected(model, prompt, k):
    """(log p(token t | tokens < t) for t >= 1, the top-k ids at each position) from one plain forward."""
    with torch.no_grad():
        logp = model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    chosen = logp.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    return chosen, torch.topk(logp, k).indices


def check(request, model, k):
    chosen, top = expected(model, PROMPT, k)
    events = request.prompt_logprobs
    assert [e.token_id for e in events] == PROMPT
    assert events[0].logprob is None and events[0].top_logprobs is None  # nothing precedes the first token
    assert torch.allclose(torch.tensor([e.logprob for e in events[1:]]), chosen, atol=1e-5)
    assert [[i for i, _ in e.top_logprobs] for e in events[1:]] == top.tolist()


@pytest.mark.parametrize("chunk", [None, 3])
def test_single_stream_scores_the_prompt_and_generates_the_same(model, chunk):
    engine = Engine(model, prefill_chunk=chunk)
    plain = engine.generate(Request(PROMPT, SamplingParams(max_tokens=4, greedy=True)))
    request = Request(PROMPT, SamplingParams(max_tokens=4, greedy=True, prompt_logprobs=2))
    assert engine.generate(request) == plain
    check(request, model, 2)


def test_max_tokens_zero_scores_without_generating(model):
    request = Request(PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert Engine(model).generate(request) == [] and request.finish_reason == "length"
    chosen, _ = expected(model, PROMPT, 1)
    assert torch.allclose(torch.tensor([e.logprob for e in request.prompt_logprobs[1:]]), chosen, atol=1e-5)
    assert all(e.top_logprobs is None for e in request.prompt_logprobs)  # k = 0: the token's own only
    unscored = Request(PROMPT, SamplingParams(max_tokens=0))
    assert Engine(model).generate(unscored) == [] and unscored.prompt_logprobs is None  # no forward at all


def test_batched_scoring_beside_a_decoding_request(model):
    batch = BatchEngine(model, slots=4)
    other = batch.submit(Request([1, 2, 3], SamplingParams(max_tokens=6, greedy=True)))
    batch.step()
    scored = batch.submit(Request(PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=3)))
    generating = batch.submit(Request(PROMPT, SamplingParams(max_tokens=3, greedy=True, prompt_logprobs=3)))
    batch.run_until_idle()
    assert scored.output_ids == [] and scored.finish_reason == "length"
    check(scored, model, 3)
    check(generating, model, 3)
    assert generating.output_ids == Engine(model).generate(Request(PROMPT, SamplingParams(max_tokens=3, greedy=True)))
    assert len(other.output_ids) == 6


def test_prompt_logprobs_out_of_range_is_refused():
    with pytest.raises(StemlmError, match="prompt_logprobs must be between 0 and 20"):
        Request(PROMPT, SamplingParams(prompt_logprobs=21))
