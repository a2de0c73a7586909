"""Tests of `stemlm.inference.generate`: cached decoding against uncached argmax, sampling filters against pure-Python
references, seeding, streaming and hooks, rows plumbing and the stopping rules."""

from __future__ import annotations

import random

import pytest
import torch

from stemlm.errors import StemlmError
from stemlm.inference.generate import generate, stream_tokens
from stemlm.inference.sampling import sample_token, top_k_filter, top_p_filter
from stemlm.model import build_model
from stemlm.model.config import ModelConfig

# initializer_range 0.1 makes logits peaked enough that greedy choices are far from ties.
CONFIG = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=40,
    initializer_range=0.1,
)
PROMPT = [5, 17, 3, 42, 8]


def tiny(ffn: str = "stem", **kw):
    return build_model(ModelConfig(**{**CONFIG, "ffn": ffn, "ffn_layers": [1, 2], **kw}), seed=3).eval()


@pytest.fixture(scope="module")
def stem():
    return tiny("stem")


@pytest.mark.parametrize("ffn", ["dense", "stem", "stem_gate", "ple", "moe", "hash_moe"])
def test_greedy_matches_uncached_argmax(ffn):
    model = tiny(ffn)
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert generate(model, PROMPT, 12, greedy=True) == ids[len(PROMPT) :]


def test_sampling_reproducible_per_seed(stem):
    a = generate(stem, PROMPT, 20, seed=7)
    assert generate(stem, PROMPT, 20, seed=7) == a
    assert generate(stem, PROMPT, 20, seed=8) != a


def test_top_k_one_and_zero_temperature_equal_greedy(stem):
    greedy = generate(stem, PROMPT, 15, greedy=True)
    assert generate(stem, PROMPT, 15, top_k=1, temperature=1.5, seed=4) == greedy
    assert generate(stem, PROMPT, 15, temperature=0.0, seed=4) == greedy


def test_prompt_forms_agree(stem):
    expected = generate(stem, PROMPT, 6, greedy=True)
    assert generate(stem, torch.tensor(PROMPT), 6, greedy=True) == expected
    assert generate(stem, torch.tensor([PROMPT]), 6, greedy=True) == expected


def _nucleus_reference(probs: list[float], p: float) -> set[int]:
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, total = set(), 0.0
    for i in order:
        kept.add(i)
        total += probs[i]
        if total >= p:
            break
    return kept


def test_top_p_hand_made_distribution():
    probs = torch.tensor([0.10, 0.05, 0.50, 0.15, 0.20])
    logits = probs.log()
    kept = lambda p: set(torch.isfinite(top_p_filter(logits, p)).nonzero().flatten().tolist())
    assert kept(0.3) == {2}  # the top token alone already reaches p
    assert kept(0.6) == {2, 4}
    assert kept(0.8) == {2, 4, 3}
    assert kept(0.9) == {2, 4, 3, 0}
    assert kept(0.99) == {0, 1, 2, 3, 4}
    assert kept(1e-6) == {2}  # the top token is always kept
    assert kept(1.0) == {0, 1, 2, 3, 4}


def test_top_p_matches_reference_on_random_rows():
    rng = random.Random(0)
    for _ in range(50):
        logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(rng.randrange(10**6))) * 3
        p = rng.uniform(0.05, 0.97)
        filtered = top_p_filter(logits, p)
        for row in range(2):
            probs = logits[row].softmax(-1).tolist()
            assert set(torch.isfinite(filtered[row]).nonzero().flatten().tolist()) == _nucleus_reference(probs, p)
            assert torch.equal(filtered[row][torch.isfinite(filtered[row])], logits[row][torch.isfinite(filtered[row])])


def test_top_k_filter_keeps_k_largest():
    logits = torch.tensor([0.3, -1.0, 2.0, 0.9, 1.5, -0.2])
    assert torch.isfinite(top_k_filter(logits, 3)).nonzero().flatten().tolist() == [2, 3, 4]
    assert torch.equal(top_k_filter(logits, 0), logits)
    assert torch.equal(top_k_filter(logits, 10), logits)


def test_sampled_frequencies_follow_filtered_distribution():
    # temperature 2 then top-p 0.8 on a hand-made distribution; compare with the renormalised target.
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0])
    tempered = (logits / 2).softmax(-1).tolist()
    kept = _nucleus_reference(tempered, 0.8)
    target = [tempered[i] / sum(tempered[j] for j in kept) if i in kept else 0.0 for i in range(5)]
    gen = torch.Generator().manual_seed(0)
    n = 4000
    counts = [0] * 5
    for _ in range(n):
        counts[sample_token(logits, temperature=2.0, top_p=0.8, generator=gen)] += 1
    for i in range(5):
        assert abs(counts[i] / n - target[i]) < 0.03, (i, counts, target)


def test_stream_equals_list_and_hook_sees_each_token_before_next_forward(stem):
    events = []

    def rows(layer, ids):
        if layer == 1:
            events.append(("forward", ids.shape[1]))
        return stem.token_tables()[layer](ids)

    tokens = generate(stem, PROMPT, 8, seed=2, rows={"token": rows}, on_token=lambda t: events.append(("token", t)))
    assert list(stream_tokens(stem, PROMPT, 8, seed=2)) == tokens
    expected = [("forward", len(PROMPT))]
    for t in tokens:
        expected += [("token", t), ("forward", 1)]
    assert events == expected[:-1]  # no forward after the last token


def test_table_rows_used_and_prefill_override(stem):
    own = lambda layer, ids: stem.token_tables()[layer](ids)
    plain = generate(stem, PROMPT, 10, greedy=True)
    assert generate(stem, PROMPT, 10, greedy=True, rows={"token": own}) == plain
    # Rows scaled at prefill only: the output changes, and decoding still went through `rows`.
    shapes = []
    scaled = lambda layer, ids: (shapes.append(tuple(ids.shape)), 25 * own(layer, ids))[1]
    edited = generate(stem, PROMPT, 10, greedy=True, rows={"token": own}, prefill_rows={"token": scaled})
    assert edited != plain
    assert shapes == [(1, len(PROMPT))] * 2  # two STEM layers, prefill only
    # Same edit done by hand: prefill with scaled rows, then cached greedy steps with the model's own rows.
    with torch.no_grad():
        out = stem(torch.tensor([PROMPT]), use_cache=True, rows={"token": scaled})
        ids = [int(out.logits[0, -1].argmax())]
        for _ in range(9):
            out = stem(torch.tensor([[ids[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            ids.append(int(out.logits[0, -1].argmax()))
    assert edited == ids


def test_embed_rows_prefill_override(stem):
    embed = stem.model.embed_tokens
    plain = generate(stem, PROMPT, 8, greedy=True)
    assert generate(stem, PROMPT, 8, greedy=True, rows={"embed": embed}) == plain
    calls = []
    shifted = lambda ids: (calls.append(tuple(ids.shape)), embed(ids) + 0.5)[1]
    edited = generate(stem, PROMPT, 8, greedy=True, prefill_rows={"embed": shifted})
    assert calls == [(1, len(PROMPT))] and edited != plain
    with torch.no_grad():
        out = stem(torch.tensor([PROMPT]), use_cache=True, rows={"embed": shifted})
        ids = [int(out.logits[0, -1].argmax())]
        for _ in range(7):
            out = stem(torch.tensor([[ids[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            ids.append(int(out.logits[0, -1].argmax()))
    assert edited == ids


def test_stops_at_eos_and_includes_it(stem):
    greedy = generate(stem, PROMPT, 10, greedy=True)
    eos = greedy[3]
    first = greedy.index(eos)
    assert generate(stem, PROMPT, 10, greedy=True, eos_id=eos) == greedy[: first + 1]


def test_stops_at_max_positions(stem):
    limit = stem.config.max_position_embeddings
    prompt = [1] * (limit - 3)
    assert len(generate(stem, prompt, 10, greedy=True)) == 3
    assert generate(stem, PROMPT, 0) == []
    with pytest.raises(StemlmError, match="max_position_embeddings"):
        stream_tokens(stem, [1] * limit, 5)  # raised at the call, before iterating
    with pytest.raises(StemlmError, match="max_position_embeddings"):
        generate(stem, [1] * (limit + 4), 5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
    ],
)
def test_bad_arguments(stem, kwargs, match):
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(StemlmError, match=match):
        generate(stem, PROMPT, **kwargs)


def test_bad_prompts(stem):
    with pytest.raises(StemlmError, match="empty"):
        generate(stem, [], 3)
    with pytest.raises(StemlmError, match="one prompt"):
        generate(stem, torch.ones(2, 3, dtype=torch.long), 3)
    with pytest.raises(StemlmError, match="out of range"):
        generate(stem, [1, 99], 3)


def test_grad_mode_untouched_between_tokens(stem):
    for _ in stream_tokens(stem, PROMPT, 3, seed=0):
        assert torch.is_grad_enabled()


def test_prompt_from_text_or_ids_and_the_timed_stream(tiny_config):
    import pytest

    from stemlm.data.tokenizer import default_tokenizer
    from stemlm.errors import StemlmError
    from stemlm.inference.generate import TimedTokens, encode_prompt

    tok = default_tokenizer()
    assert encode_prompt(tok, 8192, text="The king") == tok.encode("The king").ids
    assert encode_prompt(None, 10, ids="1, 2,3") == [1, 2, 3]
    for kw, message in ((dict(ids="1,10"), "out of vocabulary"), (dict(), "exactly one"), (dict(ids="a"), "integers")):
        with pytest.raises(StemlmError, match=message):
            encode_prompt(None, 10, **kw)
    timed = TimedTokens(iter([5, 6, 7]))
    assert list(timed) == [5, 6, 7] == timed.ids
    assert timed.first is not None and timed.first <= timed.seconds and timed.rate > 0
    assert timed.report() == {
        "token_ids": [5, 6, 7],
        "num_new_tokens": 3,
        "seconds": timed.seconds,
        "time_to_first_token_s": timed.first,
        "tokens_per_s": timed.rate,
    }
