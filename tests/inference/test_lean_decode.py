"""The lean decoding step: q/k/v and gate/up fused at load (`StemLM.fuse_for_decoding`; on a CPU the copies with at
least as many outputs as inputs, STEM's gate, o_proj and the lm_head among them, stored transposed), RoPE rows from
a table, the id check once per request. Greedy tokens equal a plain model's full recompute (no cache, no fusion, no
table) for every kind in the registry, with resident tables and, for kinds that have tables, host tables; the fused copy
never stands in for a weight that changed or a forward with grad. With the decoding steps compiled
(`InferenceOptions(compile=True)`, slow) the tokens are the same, single-stream and batched, and a weight edited
after the compile has its copy dropped before the next compiled step.

Run: `OMP_NUM_THREADS=1 python -m pytest tests/inference/test_lean_decode.py -q -m "slow or not slow"`.
"""

from __future__ import annotations

import pytest
import torch

from stemlm.checkpoint.folder import save_pretrained
from stemlm.checkpoint.runs import from_pretrained
from stemlm.inference.generate import generate
from stemlm.inference.load import InferenceOptions, load_inference
from stemlm.model.attention import RotaryEmbedding
from stemlm.model.config import FFN_KINDS
from stemlm.model.fusion import FUSED, is_fused, stored_transposed
from tests.conftest import make_tiny_model

PROMPT, NEW = [5, 17, 3, 99, 42], 12


@torch.no_grad()
def recompute_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy tokens by full recompute: every step runs the whole sequence through the plain forward."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


def fusable(model) -> list:
    return [m for m in model.modules() if hasattr(m, "fuse_projections")]


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
            assert all(is_fused(m) for m in fusable(lm.model))  # fused at load
            assert generate(lm.model, PROMPT, NEW, greedy=True) == expected, tables


def test_fused_logits_equal_the_plain_ones_and_weights_keep_their_names(checkpoint):
    plain, lean = from_pretrained(checkpoint).eval(), from_pretrained(checkpoint).eval()
    lean.fuse_for_decoding()
    assert lean.state_dict().keys() == plain.state_dict().keys()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        torch.testing.assert_close(lean(ids).logits, plain(ids).logits, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", FFN_KINDS)
def test_every_module_with_gate_and_up_of_one_input_fuses_them(kind):
    model = make_tiny_model(kind)
    both = [m for m in model.modules() if hasattr(m, "gate_proj") and hasattr(m, "up_proj")]
    assert all(hasattr(m, "fuse_projections") for m in both)
    model.fuse_for_decoding()
    assert all(is_fused(m) for m in [*both, *(layer.self_attn for layer in model.model.layers)])


def test_wide_copies_are_kept_transposed_on_a_cpu_and_narrow_weights_get_none():
    model = make_tiny_model("stem")  # d = 64, d_ff = 128, V = 256; layer 1 is a STEM layer
    model.fuse_for_decoding()
    layer = model.model.layers[1]
    assert model.__dict__[FUSED][0].shape == (64, 256)  # the lm_head's copy, [in, out]
    assert layer.mlp.__dict__[FUSED][0].shape == (64, 128)  # STEM's gate alone
    qkv = (model.config.num_attention_heads + 2 * model.config.kv_heads) * model.config.head_size
    assert layer.self_attn.__dict__[FUSED][0].shape == (64, qkv)  # q/k/v
    assert layer.self_attn.o_proj.__dict__[FUSED][0].shape == (64, 64)  # square: kept [in, out] too
    assert layer.self_attn.o_proj.__dict__[FUSED][3]
    assert FUSED not in layer.mlp.down_proj.__dict__
    assert not stored_transposed(64, 128, torch.device("cpu"))  # the down projection's shape: kept [out, in]
    assert not stored_transposed(8192, 256, torch.device("cuda"))  # the layout rule was measured on CPUs only
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, make_tiny_model("stem")(ids).logits, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("kind", "weight"),
    [
        ("dense", lambda layer: layer.self_attn.v_proj.weight),
        ("dense", lambda layer: layer.mlp.up_proj.weight),
        ("moe", lambda layer: layer.mlp.experts.gate_proj),
    ],
)
def test_a_changed_weight_or_a_forward_with_grad_takes_the_plain_projections(kind, weight):
    model = make_tiny_model(kind)
    model.fuse_for_decoding()
    layer = model.model.layers[1]  # a layer of the kind (the first is dense)
    ids = torch.tensor([PROMPT])
    model(ids).logits.sum().backward()  # with grad: the parameters' own projections, so they get gradients
    assert all(p.grad is not None for p in layer.parameters())
    with torch.no_grad():
        weight(layer).mul_(2.0)  # an in-place edit after fusing
        edited = model(ids).logits
    assert [is_fused(m) for m in fusable(layer)].count(False) == 1  # the edited one's stale copy was dropped
    fresh = make_tiny_model(kind)
    with torch.no_grad():
        weight(fresh.model.layers[1]).mul_(2.0)
        torch.testing.assert_close(edited, fresh(ids).logits, atol=0, rtol=0)


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
        assert all(is_fused(m) for m in fusable(lm.model))  # the compiled steps use the fused copies too
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
        assert not is_fused(layer.mlp) and not is_fused(lm.model.module) and is_fused(layer.self_attn)
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
