"""Edits per request in one batch: requests with and without a positional edit (and with another target)
decode together in the engine, each exactly as its own single-stream edited (or unedited) generation."""

from __future__ import annotations

import pytest

from stemlm.data.tokenizer import default_tokenizer
from stemlm.inference.batching import BatchEngine
from stemlm.inference.generate import generate
from stemlm.inference.requests import Request, SamplingParams
from stemlm.model import build_model
from stemlm.serve.editing import EditSpec
from stemlm.serve.served_model import edit_rows
from tests.serve.conftest import PROMPT, SOURCE, TARGET, serve_config

OTHER = "Spain"
NEW = 10


@pytest.mark.parametrize("ffn", ["stem", "stem_ngram"])
def test_edited_and_plain_requests_share_a_batch(ffn):
    model = build_model(serve_config(ffn), seed=0).eval()
    tok = default_tokenizer()
    ids = tok.encode(PROMPT, add_special_tokens=False).ids
    specs = [EditSpec(target=TARGET, source=SOURCE, strategy="average"), None, EditSpec(target=OTHER, source=SOURCE)]
    rows = [None if spec is None else edit_rows(model, tok, ids, spec) for spec in specs]
    expected = [generate(model, ids, NEW, greedy=True, prefill_rows=r) for r in rows]
    assert len({tuple(e) for e in expected}) > 1  # the edits change the output, or the test shows nothing
    engine = BatchEngine(model, slots=3)
    requests = [Request(ids, SamplingParams(max_tokens=NEW, temperature=0), edit_rows=r) for r in rows]
    engine.submit(requests[0])
    engine.step()
    engine.submit(requests[1])
    engine.step()
    engine.submit(requests[2])
    engine.run_until_idle()
    assert [r.output_ids for r in requests] == expected
