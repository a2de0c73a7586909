"""The decoding engine (`stemlm.inference.engine`): what reaches the model's forward and when, the row source's
announcements, the wrapper applied from outside (no rebound forward), and the decoding state the KV cache declares."""

from __future__ import annotations

import pytest
import torch

from stemlm.checkpoint.folder import save_pretrained
from stemlm.errors import StemlmError
from stemlm.inference.batching import BatchEngine
from stemlm.inference.engine import Engine
from stemlm.inference.generate import generate
from stemlm.inference.inference_model import InferenceModel
from stemlm.inference.load import InferenceOptions, load_inference
from stemlm.inference.requests import Request
from stemlm.inference.rows import ModelTables
from stemlm.inference.sampling import SamplingParams
from stemlm.model.attention import KVCache
from stemlm.model.decoder import StemLM
from stemlm.model.decoding_state import DecodingState
from tests.conftest import make_tiny_model

PROMPT = [5, 17, 3, 42, 8]
GREEDY = SamplingParams(max_tokens=3, greedy=True)


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("stem", initializer_range=0.1, max_position_embeddings=40)


class Recording(ModelTables):
    """The model's own tables, recording what the engine announces: (ids, each row's earlier ids)."""

    def __init__(self) -> None:
        self.announced: list[tuple[list[list[int]], list[list[int]]]] = []

    def announce(self, ids, host, before) -> None:
        assert torch.equal(ids.cpu(), host)
        self.announced.append((host.tolist(), [list(b) for b in before]))


def test_every_forward_is_announced_before_it_runs_with_each_rows_earlier_ids(model):
    source = Recording()
    engine = Engine(InferenceModel(model, row_source=source), prefill_chunk=2)
    tokens = engine.generate(Request(PROMPT, GREEDY))
    assert tokens == generate(model, PROMPT, 3, greedy=True)  # chunked prefill, the same greedy tokens
    assert source.announced == [
        ([[5, 17]], [[]]),
        ([[3, 42]], [[5, 17]]),
        ([[8]], [[5, 17, 3, 42]]),
        ([[tokens[0]]], [PROMPT]),
        ([[tokens[1]]], [[*PROMPT, tokens[0]]]),  # the last token is never fed back: nothing announced for it
    ]


def test_edit_rows_reach_the_prefill_only_and_engine_rows_every_forward(model):
    own = model.tables("token")
    seen = {"edit": [], "every": []}

    def provider(name):
        def rows(layer_idx, ids):
            seen[name].append(tuple(ids.shape))
            return own[layer_idx](ids)

        return rows

    engine = Engine(model, rows={"token": provider("every")})
    engine.generate(Request(PROMPT, GREEDY, edit_rows={"token": provider("edit")}))
    layers = len(own)
    assert seen["edit"] == [(1, len(PROMPT))] * layers  # the edit's rows, over the engine's, for the prompt alone
    assert seen["every"] == [(1, 1)] * 2 * layers  # the two decoding steps


def test_a_loaded_model_is_wrapped_not_rebound(model, tmp_path):
    folder = save_pretrained(model, tmp_path / "m")
    ids = torch.tensor([PROMPT])
    with load_inference(folder, InferenceOptions(dtype="bf16")) as lm:
        assert isinstance(lm.model, InferenceModel) and type(lm.model.module) is StemLM
        assert "forward" not in vars(lm.model.module)  # model(...) is StemLM.forward
        assert lm.model(ids).logits.dtype == torch.bfloat16  # the wrapper's autocast, applied from outside
        assert lm.model.module(ids).logits.dtype == torch.float32
    with load_inference(folder, InferenceOptions(tables="host", cache_rows=4)) as lm:
        assert "forward" not in vars(lm.model.module) and lm.model.row_source is lm.offloaded.rows
        assert generate(lm.model, PROMPT, 4, greedy=True) == generate(model, PROMPT, 4, greedy=True)


def test_requests_are_checked_once_and_a_zero_budget_runs_nothing(model):
    with pytest.raises(StemlmError, match="top_p must be in"):
        Request(PROMPT, SamplingParams(top_p=0.0))
    with pytest.raises(StemlmError, match="prompt is empty"):
        Request([])
    with pytest.raises(StemlmError, match="max_position_embeddings=40; shorten it"):
        Engine(model).stream(Request([1] * 40, GREEDY))  # at the call, before iteration
    assert Engine(model).generate(Request(PROMPT, SamplingParams(max_tokens=0))) == []
    engine = BatchEngine(model, slots=1)
    request = engine.submit(Request(PROMPT, SamplingParams(max_tokens=0)))
    engine.run_until_idle()
    assert request.finish_reason == "length" and request.output_ids == [] and engine.tokens == 0


def test_forced_decode_feeds_only_ids_in_the_vocabulary(model):
    logits = Engine(model).forced_decode(PROMPT, [1, 2])
    assert logits.shape == (3, model.config.vocab_size)
    with pytest.raises(StemlmError, match="continuation token id 99999 is out of range"):
        Engine(model).forced_decode(PROMPT, [1, 99999])


@pytest.mark.parametrize("ffn", ["engram", "stem_ngram"])
def test_the_cache_declares_the_decoding_state_and_its_padding(ffn):
    model = make_tiny_model(ffn)
    cache = KVCache(model.config.num_hidden_layers)
    with torch.no_grad():
        model(torch.tensor([PROMPT]), past_key_values=cache, use_cache=True)
    state = cache.state
    assert isinstance(state, DecodingState) and state.ids.tolist() == [PROMPT]
    assert not [name for name in vars(cache) if name.startswith("_")]  # nothing set on the cache by name
    assert bool(state.conv) == (ffn == "engram")
    padded = state.map(lambda value, pad: torch.cat([value.new_full((1, 2, *value.shape[2:]), pad), value], 1))
    assert padded.ids[0, :2].tolist() == [-1, -1] and all(not t[:, :2].any() for t in padded.conv.values())
    both = padded.stack(padded)
    assert both.ids.shape == (2, len(PROMPT) + 2) and all(t.shape[0] == 2 for t in both.conv.values())
