"""Prompts prefilled together (`stemlm.inference.engine.prefill_together`, the batch engine's default): the prompts a
step admits run in one forward, left-padded to the longest, and every request still gets exactly its single-stream
greedy output, for every kind; its prompt scores equal a prefill alone's; a bad prompt fails alone; host tables
group equal lengths only; an edited or longer-than-a-chunk prompt runs alone."""

from __future__ import annotations

import pytest
import torch

from stemlm.checkpoint.folder import save_pretrained
from stemlm.inference.batching import BatchEngine
from stemlm.inference.generate import generate
from stemlm.inference.load import InferenceOptions, load_inference
from stemlm.inference.requests import Request, SamplingParams
from stemlm.model.config import FFN_KINDS
from tests.inference.test_batching import MAX_TOKENS, PROMPTS, model_for


def prefill_widths(model) -> list[int]:
    """Records the batch size of every forward of more than one position (a prefill) on `model`."""
    widths: list[int] = []

    def hook(module, args):
        if args[0].shape[1] > 1:
            widths.append(args[0].shape[0])

    model.register_forward_pre_hook(hook)
    return widths


def greedy(prompt, max_tokens, **params) -> Request:
    return Request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, **params))


@pytest.mark.parametrize("ffn", FFN_KINDS)
def test_prompts_of_different_lengths_prefilled_together_give_single_stream_output(ffn):
    model = model_for(ffn)
    expected = [generate(model, p, m, greedy=True) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]
    widths = prefill_widths(model)
    engine = BatchEngine(model, slots=4, step_tokens=64)
    requests = [engine.submit(greedy(p, m)) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]
    engine.run_until_idle()
    assert widths == [3]  # the three prompts of 3 to 11 tokens in one forward (the 1-token one runs as a step)
    assert [r.output_ids for r in requests] == expected


def test_off_prefills_one_prompt_a_forward_with_the_same_output():
    model = model_for("stem")
    outputs = []
    for batch_prefill in (True, False):
        widths = prefill_widths(model)
        engine = BatchEngine(model, slots=4, batch_prefill=batch_prefill)
        requests = [engine.submit(greedy(p, m)) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]
        engine.run_until_idle()
        outputs.append([r.output_ids for r in requests])
        model._forward_pre_hooks.clear()
        assert widths == ([3] if batch_prefill else [1, 1, 1])
    assert outputs[0] == outputs[1]


def test_prompt_scores_prefilled_together_equal_a_prefill_alone():
    model = model_for("stem")
    alone = BatchEngine(model, slots=1)
    one = alone.submit(greedy(PROMPTS[2], 3, prompt_logprobs=2))
    alone.run_until_idle()
    engine = BatchEngine(model, slots=4)
    requests = [engine.submit(greedy(p, 3, prompt_logprobs=2)) for p in PROMPTS]
    engine.run_until_idle()
    together = requests[2]
    assert together.output_ids == one.output_ids
    assert [e.token_id for e in together.prompt_logprobs] == PROMPTS[2]
    mine = torch.tensor([e.logprob for e in together.prompt_logprobs[1:]])
    assert torch.allclose(mine, torch.tensor([e.logprob for e in one.prompt_logprobs[1:]]), atol=1e-5)
    assert [e.top_logprobs[0][0] for e in together.prompt_logprobs[1:]] == [
        e.top_logprobs[0][0] for e in one.prompt_logprobs[1:]
    ]


def test_a_bad_prompt_fails_alone_and_the_others_run():
    model = model_for("stem")
    engine = BatchEngine(model, slots=4)
    good = [engine.submit(greedy(p, 4)) for p in PROMPTS[:2]]
    bad = engine.submit(greedy([5, 10**6, 3], 4))
    engine.run_until_idle()
    assert bad.finish_reason == "error" and "out of range" in bad.error
    assert [r.output_ids for r in good] == [generate(model, p, 4, greedy=True) for p in PROMPTS[:2]]


def test_long_and_edited_prompts_run_alone():
    model = model_for("stem")
    widths = prefill_widths(model)
    engine = BatchEngine(model, slots=4, step_tokens=64, prefill_chunk=4)  # PROMPTS[2] has 11 tokens: 3 chunks
    edit = {"token": lambda layer, ids: model.model.layers[layer].mlp.stem_embedding(ids)}  # the model's own rows
    requests = [engine.submit(greedy(p, 5)) for p in PROMPTS[:3]]
    requests[1].edit_rows = edit
    short = engine.submit(greedy(PROMPTS[3], 5))
    engine.run_until_idle()
    # PROMPTS[0] (5 tokens) is 2 chunks too; PROMPTS[1] is edited; only PROMPTS[3] fits a chunk: nothing together
    assert max(widths) == 1
    assert [r.output_ids for r in requests + [short]] == [generate(model, p, 5, greedy=True) for p in PROMPTS]


def test_host_tables_prefill_equal_lengths_together(tmp_path):
    save_pretrained(model_for("stem_ngram"), tmp_path / "c")
    with load_inference(tmp_path / "c", InferenceOptions(tables="host", cache_rows=16)) as lm:
        widths = prefill_widths(lm.model.module)
        engine = BatchEngine(lm.model, slots=4)
        prompts = [PROMPTS[0], [1, 2, 3, 4, 5], PROMPTS[3], [6, 7, 8]]
        requests = [engine.submit(greedy(p, 5)) for p in prompts]
        engine.run_until_idle()
        # lengths 5, 5, 3, 3: the first prompt's length goes together, the others run alone (rows announced unpadded)
        assert sorted(widths) == [1, 1, 2]
        assert [r.output_ids for r in requests] == [generate(lm.model, p, 5, greedy=True) for p in prompts]
