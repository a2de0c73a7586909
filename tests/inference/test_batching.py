"""Tests of `stemlm.inference.batching`: requests joining a running batch at different times give, for every
kind, exactly their single-stream `generate` output; slots are reused, queues bounded, cancellation frees a slot."""

from __future__ import annotations

import pytest
import torch

from stemlm.errors import StemlmError
from stemlm.inference.batching import BatchEngine, EngineLoop, QueueFull
from stemlm.inference.generate import generate
from stemlm.inference.requests import Request, SamplingParams, StopText
from stemlm.model.config import FFN_KINDS
from tests.conftest import make_tiny_model

PROMPTS = [[5, 17, 3, 42, 8], [9], [200, 31, 7, 7, 64, 90, 12, 3, 77, 15, 2], [44, 45, 46]]
MAX_TOKENS = [6, 12, 9, 10]
JOIN_AT = [0, 2, 4, 7]  # the step before which each request is submitted


def model_for(ffn: str):
    # initializer_range 0.1: peaked logits, so greedy choices are far from ties (as in test_generate).
    return make_tiny_model(ffn, initializer_range=0.1, max_position_embeddings=40)


def greedy_cases(model) -> tuple[list[list[int]], list[Request]]:
    pairs = list(zip(PROMPTS, MAX_TOKENS, strict=True))
    expected = [generate(model, p, m, greedy=True) for p, m in pairs]
    return expected, [Request(p, SamplingParams(max_tokens=m, temperature=0)) for p, m in pairs]


def run_staggered(engine: BatchEngine, requests: list[Request], join_at=JOIN_AT) -> None:
    step = 0
    while step <= max(join_at) or engine.busy:
        for request, at in zip(requests, join_at, strict=True):
            if at == step:
                engine.submit(request)
        engine.step()
        step += 1


@pytest.mark.parametrize("ffn", FFN_KINDS)
def test_staggered_batch_equals_single_stream_greedy(ffn):
    model = model_for(ffn)
    expected, requests = greedy_cases(model)
    engine = BatchEngine(model, slots=4)
    run_staggered(engine, requests)
    assert [r.output_ids for r in requests] == expected
    assert all(r.finish_reason == "length" for r in requests)
    assert not engine.active and engine.length == 0


@pytest.mark.parametrize("ffn", ["stem", "engram", "stem_ngram"])
def test_slot_reuse_with_fewer_slots_than_requests(ffn):
    model = model_for(ffn)
    expected, requests = greedy_cases(model)
    engine = BatchEngine(model, slots=2)  # later requests wait, then take the rows the first ones left
    run_staggered(engine, requests, join_at=[0, 0, 0, 1])
    assert [r.output_ids for r in requests] == expected


def test_sampling_per_request_seed_temperature_top_p():
    model = model_for("stem")
    settings = [dict(temperature=0.9, seed=1), dict(temperature=1.3, top_p=0.8, seed=2), dict(temperature=0, seed=5)]
    expected = [
        generate(model, p, 10, temperature=s["temperature"], top_p=s.get("top_p", 1.0), seed=s["seed"])
        for p, s in zip(PROMPTS[:3], settings, strict=True)
    ]
    requests = [Request(p, SamplingParams(max_tokens=10, **s)) for p, s in zip(PROMPTS[:3], settings, strict=True)]
    engine = BatchEngine(model, slots=3)
    run_staggered(engine, requests, join_at=[0, 1, 3])
    assert [r.output_ids for r in requests] == expected


def test_eos_stops_and_the_row_leaves_without_stalling_others():
    model = model_for("stem")
    free = generate(model, PROMPTS[0], 12, greedy=True)
    eos = free[3]
    requests = [
        Request(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, stop_ids=(eos,))),
        Request(PROMPTS[1], SamplingParams(max_tokens=12, temperature=0)),
    ]
    engine = BatchEngine(model, slots=2)
    run_staggered(engine, requests, join_at=[0, 0])
    assert requests[0].output_ids == free[: free.index(eos) + 1] and requests[0].finish_reason == "stop"
    assert requests[1].output_ids == generate(model, PROMPTS[1], 12, greedy=True)


def test_logprobs_are_the_log_softmax_of_single_stream_logits():
    model = model_for("stem")
    request = Request(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0, logprobs=2))
    events = []
    request.on_event = lambda r, e: e is not None and events.append(e)
    engine = BatchEngine(model, slots=1)
    engine.submit(request)
    engine.run_until_idle()
    with torch.no_grad():
        logp = model(torch.tensor([PROMPTS[0]])).logits[0, -1].float().log_softmax(-1)
    assert events[0].logprob == pytest.approx(float(logp.max()), abs=1e-5)
    assert events[0].top_logprobs[0][0] == int(logp.argmax()) == events[0].token_id
    assert len(events) == 3 and all(len(e.top_logprobs) == 2 for e in events)


def test_cancel_frees_the_slot_and_queue_bound():
    model = model_for("stem")
    engine = BatchEngine(model, slots=1, max_waiting=1)
    a = engine.submit(Request(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0)))
    engine.step()
    b = engine.submit(Request(PROMPTS[1], SamplingParams(max_tokens=4, temperature=0)))
    with pytest.raises(QueueFull):
        engine.submit(Request(PROMPTS[2], SamplingParams(max_tokens=4)))
    engine.cancel(a)
    engine.run_until_idle()
    assert a.finish_reason == "cancelled" and b.output_ids == generate(model, PROMPTS[1], 4, greedy=True)
    assert not engine.active


def test_prompt_too_long_fails_only_that_request():
    model = model_for("stem")
    engine = BatchEngine(model, slots=2)
    bad = engine.submit(Request(list(range(40)), SamplingParams(max_tokens=2)))
    good = engine.submit(Request(PROMPTS[0], SamplingParams(max_tokens=2, temperature=0)))
    engine.run_until_idle()
    assert bad.finish_reason == "error" and "shorten it" in bad.error
    assert good.output_ids == generate(model, PROMPTS[0], 2, greedy=True)


def test_loop_thread_serves_and_stops():
    model = model_for("stem")
    loop = EngineLoop(BatchEngine(model, slots=2))
    requests = [loop.submit(Request(p, SamplingParams(max_tokens=5, temperature=0))) for p in PROMPTS]
    for r in requests:
        assert r.done.wait(30)
    loop.stop()
    assert not loop.thread.is_alive()
    assert [r.output_ids for r in requests] == [generate(model, p, 5, greedy=True) for p in PROMPTS]
    with pytest.raises(StemlmError, match="shutting down"):
        loop.submit(Request(PROMPTS[0]))


@pytest.mark.parametrize(
    "pieces, stops, out",
    [
        (["Hel", "lo, wor", "ld"], ["lo,"], "Hel"),
        (["a", "b", "c"], ["bd"], "abc"),
        (["xx", "ENDyy"], ["END"], "xx"),
        (["one"], [], "one"),
    ],
)
def test_stop_text_never_emits_a_stop_string(pieces, stops, out):
    stop = StopText(stops)
    text, hit = "", False
    for piece in pieces:
        emitted, hit = stop.feed(piece)
        text += emitted
        if hit:
            break
    text += "" if hit else stop.flush()
    assert text == out


def test_a_failing_prefill_fails_only_its_request():
    model = model_for("stem")

    def broken(layer_idx, ids):
        raise RuntimeError("rows unavailable")

    engine = BatchEngine(model, slots=2)
    good = engine.submit(Request(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0)))
    engine.step()
    bad = engine.submit(Request(PROMPTS[1], SamplingParams(max_tokens=4), edit_rows={"token": broken}))
    engine.run_until_idle()
    assert bad.finish_reason == "error" and "rows unavailable" in bad.error
    assert good.output_ids == generate(model, PROMPTS[0], 4, greedy=True)
