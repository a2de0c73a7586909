"""The project's own generation tester (issue 24): what transformers' `GenerationTesterMixin` checks, for every kind.

The transformers sdist ships no `tests/generation`, so these checks are written here from what transformers documents
about `generate()` (https://huggingface.co/docs/transformers/main_classes/text_generation and the generation
strategies guide): greedy and sampled decoding with their dict outputs (scores, raw logits, hidden states and eager
attention weights, counted per step), greedy against a hand-written argmax loop over full forwards and against
`use_cache=False`, seeded sampling and `num_return_sequences`, beam search and beam sample against a cache-less
run and against the log-probabilities of a full forward, continuing from a returned cache, assisted and
prompt-lookup decoding, the cache implementations, the length and stopping options, and `inputs_embeds`. Tiny
random models (`hf_model` of tests/hf/test_hf_generation.py); run with
`OMP_NUM_THREADS=1 python -m pytest tests/hf/test_hf_generation_common.py -q`.
"""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedTokenizerFast, QuantizedCache

from stemlm.data.tokenizer import default_tokenizer
from stemlm.errors import StemlmError
from stemlm.model.config import FFN_KINDS
from stemlm.model.kinds.registry import get_kind
from tests.hf.test_hf import VOCAB
from tests.hf.test_hf_generation import hf_model

PROMPT, NEW = 5, 4  # prompt length and generated tokens: enough steps to cross the prefill/decode boundary twice
ID_FREE = tuple(k for k in FFN_KINDS if not get_kind(k).reads_input_ids())  # kinds that generate from embeddings
DICT = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)
EVERY_OUTPUT = dict(DICT, output_hidden_states=True, output_attentions=True)


def prompt(batch: int = 2, length: int = PROMPT, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids that avoid the pad id 0 (so transformers infers no padding), and their all-ones mask."""
    ids = torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    return ids, torch.ones_like(ids)


def greedy(model, ids, mask, new: int = NEW, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **kwargs)


def eager(kind: str):
    model = hf_model(kind)
    model.set_attn_implementation("eager")
    return model


@torch.no_grad()
def manual_greedy(model, ids: torch.Tensor, new: int) -> torch.Tensor:
    """Greedy decoding by hand: a full forward (no cache) over the whole sequence for every token."""
    for _ in range(new):
        logits = model(ids, use_cache=False).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids


@torch.no_grad()
def sequence_logprob(model, sequences: torch.Tensor, start: int) -> torch.Tensor:
    """[N] summed log-probability of each sequence's tokens from `start` on, from one cache-less forward."""
    logprobs = model(sequences, use_cache=False).logits.log_softmax(-1)[:, start - 1 : -1]
    return logprobs.gather(-1, sequences[:, start:, None]).squeeze(-1).sum(-1)


def check_dict_outputs(model, out, rows: int, use_cache: bool) -> None:
    """Shapes and counts per generated step, as transformers documents them for a decoder-only model."""
    config = model.config
    assert out.sequences.shape == (rows, PROMPT + NEW)
    for name in ("scores", "logits", "hidden_states", "attentions"):
        steps = getattr(out, name)
        assert steps is not None and len(steps) == NEW, name
    for step in range(NEW):
        keys = PROMPT + step  # positions attended to at this step
        queries = keys if step == 0 or not use_cache else 1  # a cached step feeds only the newest token
        assert out.scores[step].shape == out.logits[step].shape == (rows, config.vocab_size)
        hidden = out.hidden_states[step]
        assert len(hidden) == config.num_hidden_layers + 1  # the embeddings, then every layer's output
        assert all(h.shape == (rows, queries, config.hidden_size) for h in hidden)
        # The last hidden state is the one the head reads: the step's raw logits come from it.
        torch.testing.assert_close(model.lm_head(hidden[-1][:, -1]), out.logits[step], atol=1e-5, rtol=1e-5)
        weights = out.attentions[step]
        assert len(weights) == config.num_hidden_layers
        for w in weights:
            assert w.shape == (rows, config.num_attention_heads, queries, keys)
            torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]))  # softmax rows
            assert torch.all(w.triu(keys - queries + 1) == 0)  # causal: nothing after the query's own position
    if use_cache:
        assert out.cache is not None and out.cache.get_seq_length() == PROMPT + NEW - 1


# ----------------------------------------------------------------------------------------------------------
# greedy
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", FFN_KINDS)
@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_dict_outputs(kind, use_cache):
    model = eager(kind)
    ids, mask = prompt()
    out = greedy(model, ids, mask, use_cache=use_cache, **EVERY_OUTPUT)
    check_dict_outputs(model, out, 2, use_cache)
    # No logits processor in plain greedy decoding: the scores are the raw logits, and their argmax the tokens.
    for score, logit in zip(out.scores, out.logits, strict=True):
        torch.testing.assert_close(score, logit)
    assert torch.equal(torch.stack(out.scores, 1).argmax(-1), out.sequences[:, PROMPT:])


@pytest.mark.parametrize("kind", FFN_KINDS)
def test_greedy_equals_a_manual_argmax_loop_and_no_cache(kind):
    model = hf_model(kind)
    ids, mask = prompt(seed=1)
    cached = greedy(model, ids, mask, new=6)
    assert torch.equal(cached, manual_greedy(model, ids, 6))
    assert torch.equal(cached, greedy(model, ids, mask, new=6, use_cache=False))
    assert len(set(cached[:, PROMPT:].flatten().tolist())) > 2  # varied tokens, so the comparison bites


@pytest.mark.parametrize("kind", FFN_KINDS)
def test_eager_attention_generates_what_sdpa_generates(kind):
    model = hf_model(kind)
    ids, mask = prompt(seed=1)
    sdpa = greedy(model, ids, mask, new=6)
    model.set_attn_implementation("eager")
    assert torch.equal(greedy(model, ids, mask, new=6), sdpa)


# ----------------------------------------------------------------------------------------------------------
# sampling
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", FFN_KINDS)
def test_sample_dict_outputs_seeded_and_num_return_sequences(kind):
    model = eager(kind)
    ids, mask = prompt()

    def sample(seed: int):
        torch.manual_seed(seed)
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, num_return_sequences=2, **EVERY_OUTPUT
        )

    out = sample(0)
    check_dict_outputs(model, out, 4, use_cache=True)
    assert torch.equal(out.sequences[:, :PROMPT], ids.repeat_interleave(2, dim=0))  # rows 0, 1 from prompt 0
    chosen = torch.stack(out.scores, 1).gather(-1, out.sequences[:, PROMPT:, None])
    assert torch.isfinite(chosen).all()  # every sampled token survived the processors (top-k)
    assert torch.equal(sample(0).sequences, out.sequences)
    assert any(not torch.equal(sample(seed).sequences, out.sequences) for seed in (1, 2, 3))


@pytest.mark.parametrize("kind", FFN_KINDS)
def test_sampling_with_top_k_one_is_greedy(kind):
    model = hf_model(kind)
    ids, mask = prompt(seed=2)
    sampled = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, top_k=1)
    assert torch.equal(sampled, greedy(model, ids, mask))


# ----------------------------------------------------------------------------------------------------------
# beam search and beam sample
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", FFN_KINDS)
@pytest.mark.parametrize("do_sample", [False, True], ids=["beam_search", "beam_sample"])
def test_beams_equal_a_cacheless_run_and_full_forward_scores(kind, do_sample):
    model = eager(kind)
    ids, mask = prompt(seed=3)

    def beams(use_cache: bool):
        torch.manual_seed(0)
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=NEW, num_beams=2, num_return_sequences=2, do_sample=do_sample,
            use_cache=use_cache, **EVERY_OUTPUT,
        )  # fmt: skip

    out = beams(True)
    # 2 prompts x 2 beams rows per step, and 2 x 2 returned sequences
    check_dict_outputs(model, out, 4, use_cache=True)
    assert out.sequences_scores.shape == (4,) and out.beam_indices.shape == (4, NEW)
    assert not torch.equal(out.sequences[0], out.sequences[1])  # two distinct beams per prompt
    reference = beams(False)
    assert torch.equal(out.sequences, reference.sequences)
    torch.testing.assert_close(out.sequences_scores, reference.sequences_scores)
    # A beam's score is its summed token log-probability over its length (length_penalty 1.0).
    logprob = sequence_logprob(model, out.sequences, PROMPT)
    torch.testing.assert_close(out.sequences_scores, logprob / NEW, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------
# the cache: continuing, formats
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", FFN_KINDS)
def test_continuing_from_the_returned_cache_equals_one_go(kind):
    model = hf_model(kind)
    ids, mask = prompt(seed=4)
    first = greedy(model, ids, mask, new=3, return_dict_in_generate=True)
    # The cache holds every position but the last token, which the next call feeds first.
    assert first.cache.get_seq_length() == first.sequences.shape[1] - 1
    config = model.stem.config  # the cache's layout: one layer per decoder layer, [B, kv heads, positions, head]
    assert len(first.cache.layers) == config.num_hidden_layers
    for layer in first.cache.layers:
        assert layer.keys.shape == layer.values.shape == (2, config.kv_heads, PROMPT + 2, config.head_size)
    more = greedy(model, first.sequences, torch.ones_like(first.sequences), new=3, cache=first.cache)
    assert torch.equal(more, greedy(model, ids, mask, new=6))


@pytest.mark.parametrize("kind", FFN_KINDS)
def test_cache_implementations(kind):
    model = hf_model(kind)
    ids, mask = prompt(seed=5)
    reference = greedy(model, ids, mask)
    fp8 = dict(cache_implementation="quantized", cache_config={"backend": "fp8"})
    quant = greedy(model, ids, mask, return_dict_in_generate=True, **fp8)
    assert isinstance(quant.cache, QuantizedCache)
    assert torch.equal(quant.sequences[:, : PROMPT + 1], reference[:, : PROMPT + 1])  # prefill reads fp32 keys
    # Static caches pre-allocate slots that our attention has no mask over: refused in one line.
    with pytest.raises(StemlmError, match="static"):
        greedy(model, ids, mask, cache_implementation="static")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="transformers' offloaded cache prefetches on a CUDA stream")
@pytest.mark.parametrize("kind", FFN_KINDS)
def test_offloaded_cache(kind):
    model = hf_model(kind).cuda()
    ids, mask = (t.cuda() for t in prompt(seed=5))
    assert torch.equal(greedy(model, ids, mask, cache_implementation="offloaded"), greedy(model, ids, mask))


# ----------------------------------------------------------------------------------------------------------
# assisted and prompt-lookup decoding
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", FFN_KINDS)
def test_assisted_and_prompt_lookup_decoding_equal_greedy(kind):
    model = hf_model(kind)
    other = hf_model(kind)
    with torch.no_grad():  # a different assistant, so some candidates are rejected and the cache is cropped
        for param in other.parameters():
            param.mul_(-1.0)
    ids, mask = prompt(batch=1, length=8, seed=6)
    ids[0, 4:] = ids[0, :4]  # a repeated n-gram for prompt lookup to find
    reference = greedy(model, ids, mask, new=6)
    for assistant in (model, other):
        assistant.generation_config.num_assistant_tokens = 2
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assert torch.equal(greedy(model, ids, mask, new=6, assistant_model=assistant), reference)
    assert torch.equal(greedy(model, ids, mask, new=6, prompt_lookup_num_tokens=2), reference)


@pytest.mark.parametrize("kind", FFN_KINDS)
def test_assisted_sampling_outputs_and_seed(kind):
    model = eager(kind)
    model.generation_config.num_assistant_tokens = 2
    ids, mask = prompt(batch=1, seed=6)

    def sample():
        torch.manual_seed(0)
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, assistant_model=model, **EVERY_OUTPUT
        )

    out = sample()
    assert out.sequences.shape == (1, PROMPT + NEW) and len(out.scores) == len(out.logits) == NEW
    assert all(score.shape == (1, VOCAB) for score in out.scores)
    # Hidden states and weights come per verification forward, which covers one or more tokens.
    assert len(out.hidden_states) == len(out.attentions) <= NEW
    assert torch.equal(sample().sequences, out.sequences)


# ----------------------------------------------------------------------------------------------------------
# lengths and stopping
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", FFN_KINDS)
def test_min_and_max_new_tokens_and_eos_lists(kind):
    model = hf_model(kind)
    ids, mask = prompt(batch=1, seed=7)
    free = greedy(model, ids, mask, new=6)[0, PROMPT:].tolist()
    assert greedy(model, ids, mask, new=3).shape[1] == PROMPT + 3
    stop = free[2]
    unused = next(t for t in range(1, VOCAB) if t not in free)
    stopped = greedy(model, ids, mask, new=6, eos_token_id=[unused, stop])[0, PROMPT:].tolist()
    assert stopped == free[: free.index(stop) + 1]
    # min_new_tokens masks the end-of-sequence ids until that many tokens are out.
    late = greedy(model, ids, mask, new=6, eos_token_id=[unused, stop], min_new_tokens=5)[0, PROMPT:].tolist()
    assert len(late) >= 5 and stop not in late[:5]


@pytest.mark.parametrize("kind", FFN_KINDS)
def test_a_finished_row_is_padded_while_the_batch_goes_on(kind):
    model = hf_model(kind)
    ids, mask = prompt(seed=10)
    free = greedy(model, ids, mask, new=6)[:, PROMPT:]
    first, second = free.tolist()
    stop = next(t for t in first[:5] if t not in second)  # ends row 0 early and never row 1
    end = first.index(stop) + 1
    out = greedy(model, ids, mask, new=6, eos_token_id=stop)[:, PROMPT:].tolist()
    assert out[0] == first[:end] + [model.config.pad_token_id] * (6 - end) and end < 6
    assert out[1] == second


def test_stop_strings():
    # Stopping criteria read only the generated ids, never the model's kind: one kind suffices.
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=default_tokenizer())
    model = hf_model("stem")
    ids, mask = prompt(batch=1, seed=8)
    free = greedy(model, ids, mask, new=6)[0, PROMPT:].tolist()
    text = tokenizer.decode(free[:3])
    stopped = greedy(model, ids, mask, new=6, stop_strings=[text[-2:]], tokenizer=tokenizer)[0, PROMPT:]
    assert 0 < len(stopped) <= 3 and tokenizer.decode(stopped.tolist()).endswith(text[-2:])


# ----------------------------------------------------------------------------------------------------------
# inputs_embeds
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", FFN_KINDS)
def test_generate_from_inputs_embeds(kind):
    model = hf_model(kind)
    ids, mask = prompt(seed=9)
    embeds = model.get_input_embeddings()(ids)
    reference = greedy(model, ids, mask)
    # With the ids as well, the embeddings replace embed_tokens' output and the ids feed the kind's tables.
    assert torch.equal(greedy(model, ids, mask, inputs_embeds=embeds), reference)
    assert not torch.equal(greedy(model, ids, mask, inputs_embeds=torch.zeros_like(embeds)), reference)  # read
    if kind in ID_FREE:  # only the new tokens come back, as transformers documents for inputs_embeds alone
        alone = model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        assert torch.equal(alone, reference[:, PROMPT:])
    else:
        with pytest.raises(StemlmError, match="reads the token ids"):
            model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
