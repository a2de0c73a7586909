"""The batch engine's admission (`stemlm.inference.batching`), untimed: the order in which waiting requests get
slots (fair between groups, per sequence), the step's token budget, and chunked prefill beside decoding rows."""

from __future__ import annotations

import pytest

from stemlm.errors import StemlmError
from stemlm.inference.batching import BatchEngine
from stemlm.inference.generate import generate
from stemlm.inference.requests import Request, SamplingParams, new_group
from tests.inference.test_batching import PROMPTS, model_for


def greedy(prompt, max_tokens, group=None) -> Request:
    return Request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0), group=group)


def admitted_in_order(engine: BatchEngine, requests: list[Request]) -> list[int]:
    """Run the engine until idle; the ids of `requests` in the order they were admitted."""
    engine.run_until_idle()
    return [r.id for r in sorted(requests, key=lambda r: r.admitted_at)]


def test_a_small_request_gets_the_next_free_slot_before_a_big_requests_remaining_sequences():
    engine = BatchEngine(model_for("stem"), slots=4)
    group = new_group()
    big = [engine.submit(greedy(PROMPTS[i % 4], 8, group)) for i in range(12)]  # one request of 12 prompts
    engine.step()
    # the slots are counted per sequence: 4 of the 12 run (their rows in the order their prefills ended)
    assert sorted(r.id for r in engine.active) == [r.id for r in big[:4]]
    small = engine.submit(greedy(PROMPTS[1], 2))
    order = admitted_in_order(engine, big[4:] + [small])
    assert order == [small.id] + [r.id for r in big[4:]]  # the first slot that frees is the small one's
    assert all(r.finish_reason == "length" for r in big + [small])
    assert small.output_ids == generate(engine.engine.model, PROMPTS[1], 2, greedy=True)


def test_groups_take_turns_for_free_slots():
    engine = BatchEngine(model_for("stem"), slots=2)
    a, b = new_group(), new_group()
    first = [engine.submit(greedy(PROMPTS[0], 3, a)) for _ in range(3)]
    second = [engine.submit(greedy(PROMPTS[2], 3, b)) for _ in range(3)]
    order = admitted_in_order(engine, first + second)
    assert order[:4] == [first[0].id, second[0].id, first[1].id, second[1].id]


def test_a_long_prompt_is_prefilled_in_chunks_while_the_batch_decodes():
    model = model_for("stem")
    engine = BatchEngine(model, slots=2, step_tokens=5, prefill_chunk=4)
    running = engine.submit(greedy(PROMPTS[0], 12))
    engine.step()
    long = engine.submit(greedy(PROMPTS[2], 4))  # 11 prompt tokens: chunks of 4, 4 and 3, one a step
    tokens = []
    for step in range(3):
        engine.step()
        tokens.append(len(running.output_ids))
        assert (long.id in [r.id for r in engine.active]) == (step == 2)
    assert tokens == [3, 4, 5]  # the running request decoded a token at every step of the long prefill
    assert len(long.output_ids) == 2
    engine.run_until_idle()
    assert running.output_ids == generate(model, PROMPTS[0], 12, greedy=True)
    assert long.output_ids == generate(model, PROMPTS[2], 4, greedy=True)


def test_a_step_prefills_new_prompts_up_to_its_budget():
    engine = BatchEngine(model_for("stem"), slots=8, step_tokens=12)
    requests = [engine.submit(greedy(p, 6)) for p in PROMPTS]  # 5, 1, 11 and 3 prompt tokens
    engine.step()  # 5 + 1 fit; the 11-token prompt is admitted, but its chunk would pass 12: it waits
    assert sorted(r.id for r in engine.active) == [r.id for r in requests[:2]]  # rows in the order prefills ended
    assert [run.position for run in engine.prefilling] == [0] and len(engine.waiting) == 1
    engine.step()  # 2 decode rows + 11 > 12, but a step's first chunk always runs; the 3 tokens wait
    assert sorted(r.id for r in engine.active) == [r.id for r in requests[:3]]
    assert [(run.request.id, run.position) for run in engine.prefilling] == [(requests[3].id, 0)]
    engine.run_until_idle()
    assert all(r.finish_reason == "length" for r in requests)


def test_the_budget_is_checked():
    with pytest.raises(StemlmError, match="budget"):
        BatchEngine(model_for("stem"), step_tokens=0)


def test_queue_wait_and_first_token_times_are_recorded():
    engine = BatchEngine(model_for("stem"), slots=1)
    first, second = engine.submit(greedy(PROMPTS[0], 3)), engine.submit(greedy(PROMPTS[1], 3))
    engine.run_until_idle()
    for r in (first, second):
        assert r.submitted_at <= r.admitted_at <= r.first_token_at
    assert second.admitted_at >= first.first_token_at  # it waited for the one slot
