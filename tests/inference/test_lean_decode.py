"""The lean decoding step: q/k/v and gate/up fused at load (`fusion.fuse_for_decoding`; on a CPU the copies with at
least as many outputs as inputs, STEM's gate, o_proj and the lm_head among them, stored transposed), RoPE rows from
a table, the id check once per request. Greedy tokens equal a plain model's full recompute (no cache, no fusion, no
table) for every kind in the registry, with resident tables and, for kinds that have tables, host tables
(tests/model/test_fusion.py checks the fusion itself). With the decoding steps compiled
(`InferenceOptions(compile=True)`, slow) the tokens are the same, single-stream and batched, and a weight edited
after the compile has its copy dropped before the next compiled step.

Run: `OMP_NUM_THREADS=1 python -m pytest tests/inference/test_lean_decode.py -q -m "slow or not slow"`.
"""

from __future__ import annotations

import pytest
import torch

from stemlm.checkpoint.folder import save_pretrained
from stemlm.checkpoint.runs import from_pretrained
from stemlm.inference.batching import BatchEngine
from stemlm.inference.generate import generate
from stemlm.inference.load import InferenceOptions, load_inference
from stemlm.model.attention import RotaryEmbedding
from stemlm.model.config import FFN_KINDS
from tests.conftest import make_tiny_model
from tests.inference.test_batching import greedy_cases, run_staggered
from tests.model.test_fusion import all_fused

PROMPT, NEW = [5, 17, 3, 99, 42], 12


@torch.no_grad()
def recompute_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy tokens by full recompute: every step runs the whole sequence through the plain forward."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


@pytest.fixture(scope="module", params=FFN_KINDS)
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lean") / request.param
    save_pretrained(make_tiny_model(request.param, initializer_range=0.1, max_position_embeddings=40), folder)
    return folder


def test_greedy_tokens_equal_the_plain_recompute(checkpoint):
    plain = from_pretrained(checkpoint).eval()
    expected = recompute_greedy(plain, PROMPT, NEW)
    placements = ["device"] + (["host"] if plain.lookup_tables() else [])
    for tables in placements:
        with load_inference(checkpoint, InferenceOptions(tables=tables)) as lm:
            assert all_fused(lm.model)  # fused at load
            assert generate(lm.model, PROMPT, NEW, greedy=True) == expected, tables


def test_rope_table_rows_equal_the_computed_ones():
    rope = RotaryEmbedding(16, 10000.0)
    for start, length in ((0, 7), (3, 1), (30, 1), (12, 20)):  # the table grows past its first size
        positions = torch.arange(start, start + length)[None]
        for got, want in zip(rope.table(start, length, torch.float32), rope(positions, torch.float32), strict=True):
            torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_decoding_checks_the_prompt_ids_once(monkeypatch):
    import stemlm.model.decoder as decoder

    model, calls = make_tiny_model("stem"), []
    real = decoder.check_token_ids
    monkeypatch.setattr(decoder, "check_token_ids", lambda ids, vocab: (calls.append(ids.shape), real(ids, vocab)))
    generate(model, PROMPT, 6, greedy=True)
    assert calls == [torch.Size([1, len(PROMPT)])]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "stem"])
def test_compiled_decoding_gives_the_plain_recompute_greedy_tokens(kind, tmp_path):
    folder = save_pretrained(make_tiny_model(kind, initializer_range=0.1, max_position_embeddings=40), tmp_path / kind)
    expected = recompute_greedy(from_pretrained(folder).eval(), PROMPT, NEW)
    with load_inference(folder, InferenceOptions(compile=True)) as lm:
        assert all_fused(lm.model)  # the compiled steps use the fused copies too
        assert generate(lm.model, PROMPT, NEW, greedy=True) == expected


@pytest.mark.slow
def test_compiled_decoding_drops_the_copy_of_a_weight_edited_after_compiling(tmp_path):
    model = make_tiny_model("dense", initializer_range=0.1, max_position_embeddings=40)
    folder = save_pretrained(model, tmp_path / "m")
    plain = from_pretrained(folder).eval()
    with load_inference(folder, InferenceOptions(compile=True)) as lm:
        before = generate(lm.model, PROMPT, NEW, greedy=True)  # compiled with every copy in place
        layer = lm.model.module.model.layers[1]
        with torch.no_grad():
            for model in (lm.model.module, plain):
                model.model.layers[1].mlp.up_proj.weight.mul_(3.0)
                model.lm_head.weight.mul_(1.5)
        after = generate(lm.model, PROMPT, NEW, greedy=True)
        copies = (layer.mlp.up_proj, lm.model.module.lm_head, layer.self_attn.q_proj)
        assert [m.group.copy is not None for m in copies] == [False, False, True]
    assert after == recompute_greedy(plain, PROMPT, NEW) != before


@pytest.mark.slow
def test_compiled_batched_decoding_gives_the_eager_outputs(tmp_path):
    from stemlm.inference.batching import BatchEngine
    from stemlm.inference.requests import Request, SamplingParams

    folder = save_pretrained(make_tiny_model("stem", initializer_range=0.1, max_position_embeddings=64), tmp_path / "m")

    def outputs(model) -> list[list[int]]:
        # requests joining a running batch at different steps: batch sizes and cache lengths change
        engine, requests = BatchEngine(model, slots=4), []
        for prompt, n in (([5, 17, 3], 12), ([9, 8, 7, 6, 5, 4], 10), ([1, 2], 14)):
            requests.append(engine.submit(Request(prompt, SamplingParams(max_tokens=n, temperature=0))))
            engine.step()
        engine.run_until_idle()
        return [r.output_ids for r in requests]

    with load_inference(folder) as eager, load_inference(folder, InferenceOptions(compile=True)) as compiled:
        assert outputs(compiled.model) == outputs(eager.model)


@pytest.mark.slow
def test_compiled_batched_decoding_gives_the_single_stream_greedy_tokens(tmp_path):
    folder = save_pretrained(make_tiny_model("stem", initializer_range=0.1, max_position_embeddings=40), tmp_path / "m")
    with load_inference(folder) as plain:
        expected, _ = greedy_cases(plain.model)
    with load_inference(folder, InferenceOptions(compile=True)) as lm:
        _, requests = greedy_cases(lm.model)  # staggered: batches of 1..4 rows, with and without padding
        run_staggered(BatchEngine(lm.model, slots=4), requests)
    assert [r.output_ids for r in requests] == expected
