"""The playground's JSON API on a live server: generation, the heat map, nearest tokens, edits, errors.

Numbers are checked against independent computations: greedy decoding by full recomputation without a KV
cache, an edit written into a deep copy of the tables (the prompt holds the source once, so a global write
equals the positional swap), the STEM FFN output from its weights, cosines from normalised rows.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from stemlm.data.tokenizer import default_tokenizer

from .conftest import PROMPT, SOURCE, TARGET

TOK = default_tokenizer()


def post(client, path, **body):
    response = client.post(path, json=body)
    return response.status_code, response.get_json()


def events(response) -> list[tuple[str, dict]]:
    out = []
    for frame in response.get_data(as_text=True).split("\n\n"):
        if frame.strip():
            lines = dict(line.split(": ", 1) for line in frame.splitlines())
            out.append((lines["event"], json.loads(lines["data"])))
    return out


def ids_of(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False).ids


@torch.no_grad()
def greedy_by_recompute(model, ids, n):
    ids = list(ids)
    out = []
    for _ in range(n):
        token = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
        out.append(token)
        if token == TOK.token_to_id("<|endoftext|>"):
            break
    return out


@torch.no_grad()
def edited_copy(model, source: str, target: str, layers=None):
    """A deep copy whose table rows of the (single-token) source are the mean of the target's rows (the
    `average` strategy for a one-token source)."""
    clone = copy.deepcopy(model)
    (src,) = ids_of(" " + source)
    tgt = ids_of(" " + target)
    for i, table in clone.token_tables().items():
        if layers is None or i in layers:
            table.weight[src] = table.weight[tgt].mean(0)
    return clone


def test_info_and_tokenize(client_for, stem_ckpt):
    client, pg = client_for(stem_ckpt)
    info = client.get("/api/info").get_json()
    assert info["table_layers"] == [1, 2] and info["tables"] == "resident" and info["editing"] is None
    assert info["can_save"] is False and "Germany" in info["entities"]
    status, body = post(client, "/api/tokenize", prompt=PROMPT)
    assert status == 200 and [t["id"] for t in body["tokens"]] == ids_of(PROMPT)
    assert "".join(t["text"] for t in body["tokens"]) == PROMPT


def test_generate_streams_greedy_tokens(client_for, stem_ckpt):
    client, pg = client_for(stem_ckpt)
    response = client.post("/api/generate", json={"prompt": PROMPT, "max_new_tokens": 6, "greedy": True})
    assert response.status_code == 200 and response.mimetype == "text/event-stream"
    evs = events(response)
    tokens = [data["id"] for kind, data in evs if kind == "token" and data["id"] is not None]
    assert tokens == greedy_by_recompute(pg.model, ids_of(PROMPT), 6)
    kind, done = evs[-1]
    assert kind == "done" and done["num_tokens"] == 6 and done["cache"] is None
    assert done["completion"] == TOK.decode(tokens) == "".join(d["text"] for k, d in evs if k == "token")


def test_sampled_generation_is_seeded(client_for, stem_ckpt):
    client, _ = client_for(stem_ckpt)
    body = {"prompt": PROMPT, "max_new_tokens": 8, "greedy": False, "temperature": 1.5, "top_p": 0.9}
    runs = [events(client.post("/api/generate", json={**body, "seed": s})) for s in (1, 1, 2)]
    runs = [[d["id"] for k, d in run if k == "token"] for run in runs]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_edit_matches_an_independent_edit(client_for, stem_ckpt):
    client, pg = client_for(stem_ckpt)
    status, body = post(
        client,
        "/api/edit",
        prompt=PROMPT,
        source=SOURCE,
        target=TARGET,
        strategy="average",
        max_new_tokens=4,
        greedy=True,
        show_top=5,
    )
    assert status == 200, body
    ids = torch.tensor([ids_of(PROMPT)])
    with torch.no_grad():
        before = pg.model(ids).logits[0, -1].softmax(-1)
        after = edited_copy(pg.model, SOURCE, TARGET)(ids).logits[0, -1].softmax(-1)
    assert body["positions"] == [ids_of(PROMPT).index(ids_of(" " + SOURCE)[0])] and body["layers"] == [1, 2]
    for side, probs, other in (("before", before, after), ("after", after, before)):
        top = body[side]["top"]
        assert [t["id"] for t in top] == torch.topk(probs, 5).indices.tolist()
        assert [t["prob"] for t in top] == pytest.approx(torch.topk(probs, 5).values.tolist(), rel=1e-5)
        assert [t["other_prob"] for t in top] == pytest.approx([float(other[t["id"]]) for t in top], rel=1e-5)
    assert body["before"]["ids"] == greedy_by_recompute(pg.model, ids_of(PROMPT), 4)
    assert body["after"]["ids"][0] == int(after.argmax()) != body["before"]["ids"][0]  # the fixture's promise
    assert body["max_abs_prob_change"] == pytest.approx(float((after - before).abs().max()), rel=1e-4)


def test_edit_rows_stem_is_the_old_name_of_tables(client_for, stem_ckpt):
    client, _ = client_for(stem_ckpt)
    common = dict(prompt=PROMPT, source=SOURCE, target=TARGET, max_new_tokens=3, greedy=True)
    _, new = post(client, "/api/edit", rows="tables", **common)
    _, old = post(client, "/api/edit", rows="stem", **common)
    for key in ("positions", "layers", "before", "after"):
        assert old[key] == new[key]
    status, _ = post(client, "/api/edit", rows="bogus", **common)
    assert status == 400


def test_picked_span_equals_the_named_source(client_for, stem_ckpt):
    client, _ = client_for(stem_ckpt)
    pos = ids_of(PROMPT).index(ids_of(" " + SOURCE)[0])
    common = dict(prompt=PROMPT, target=TARGET, max_new_tokens=3, greedy=True)
    _, by_name = post(client, "/api/edit", source=SOURCE, **common)
    _, by_span = post(client, "/api/edit", span=[pos, pos + 1], source="ignored when a span is picked", **common)
    for key in ("positions", "before", "after"):
        assert by_span[key] == by_name[key]


def test_edit_in_chosen_layers_only(client_for, stem_ckpt):
    client, pg = client_for(stem_ckpt)
    body = dict(prompt=PROMPT, source=SOURCE, target=TARGET, strategy="average", layers=[2], show_top=3)
    _, body = post(client, "/api/edit", **body)
    with torch.no_grad():
        after = edited_copy(pg.model, SOURCE, TARGET, layers=[2])(torch.tensor([ids_of(PROMPT)])).logits[0, -1]
    assert body["layers"] == [2]
    expected = torch.topk(after.softmax(-1), 3).values.tolist()
    assert [t["prob"] for t in body["after"]["top"]] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    "body, status, message",
    [
        (dict(prompt=""), 400, "prompt is empty"),
        (dict(prompt="   "), 400, "prompt is empty"),
        (dict(source="Spain"), 400, "does not occur in the prompt"),
        (dict(target=""), 400, "target is empty"),
        (dict(target=SOURCE), 400, "would change nothing"),
        (dict(source=None), 400, "no source"),
        (dict(span=[4, 9]), 400, "not a token range"),
        (dict(span=[1]), 400, "span must be [start, end]"),
        (dict(strategy="one_to_one"), 400, "needs equal lengths"),
        (dict(strategy="sideways"), 400, "strategy must be one of"),
        (dict(layers=[0]), 400, "layer 0 is not a STEM layer"),
        (dict(layers=[]), 400, "no STEM layer chosen"),
        (dict(max_new_tokens=0), 400, "max_new_tokens must be between 1"),
        (dict(temperature=-1), 400, "temperature must be between 0"),
        (dict(top_p=0), 400, "top_p must be between"),
        (dict(greedy="yes"), 400, "greedy must be true or false"),
    ],
)
def test_bad_edit_requests_get_a_message(client_for, stem_ckpt, body, status, message):
    client, _ = client_for(stem_ckpt)
    got_status, got = post(client, "/api/edit", **{**dict(prompt=PROMPT, source=SOURCE, target=TARGET), **body})
    assert got_status == status and message in got["error"], got


def test_malformed_requests_are_json_errors(client_for, stem_ckpt):
    client, pg = client_for(stem_ckpt)
    response = client.post("/api/generate", data="not json", content_type="application/json")
    assert response.status_code == 400 and "JSON object" in response.get_json()["error"]
    response = client.get("/api/nothing-here")
    assert response.status_code == 404 and "error" in response.get_json()
    response = client.get("/api/edit")
    assert response.status_code == 405 and "error" in response.get_json()
    long_prompt = " word" * 200  # more tokens than max_position_embeddings = 128
    status, body = post(client, "/api/generate", prompt=long_prompt)
    assert status == 400 and "at most 127" in body["error"]


def test_unexpected_failure_is_json_without_traceback(client_for, stem_ckpt, monkeypatch):
    client, pg = client_for(stem_ckpt)

    def broken():
        raise RuntimeError("boom")

    monkeypatch.setattr(pg, "info", broken)
    response = client.get("/api/info")
    assert response.status_code == 500
    assert response.get_json() == {"error": "internal error (RuntimeError); see the server log"}


def test_dense_checkpoint_cannot_be_edited_but_generates(client_for, dense_ckpt):
    client, pg = client_for(dense_ckpt)
    info = client.get("/api/info").get_json()
    assert info["table_layers"] == [] and "no STEM tables" in info["editing"]
    status, body = post(client, "/api/edit", prompt=PROMPT, source=SOURCE, target=TARGET)
    assert status == 400 and "no STEM tables" in body["error"]
    status, body = post(client, "/api/contribution", prompt=PROMPT)
    assert status == 400 and "STEM model" in body["error"]
    status, body = post(client, "/api/edit", prompt=PROMPT, source=SOURCE, target=TARGET, rows="embed", layers=None)
    assert status == 200 and body["embed"] is True and body["layers"] == []
    assert events(client.post("/api/generate", json={"prompt": PROMPT, "max_new_tokens": 2}))[-1][0] == "done"


@torch.no_grad()
def test_contribution_reports_the_stem_ffn_output_norms(client_for, stem_ckpt):
    client, pg = client_for(stem_ckpt)
    status, body = post(client, "/api/contribution", prompt=PROMPT)
    assert status == 200 and body["layers"] == [1, 2]
    ids = torch.tensor([ids_of(PROMPT)])
    inputs = {}
    handles = [
        pg.model.model.layers[i].post_attention_layernorm.register_forward_hook(
            lambda _m, _i, out, i=i: inputs.__setitem__(i, out[0])
        )
        for i in (1, 2)
    ]
    logits = pg.model(ids).logits[0, -1]
    for h in handles:
        h.remove()
    assert body["predicted"]["id"] == int(logits.argmax())
    for row, i in enumerate(body["layers"]):
        mlp = pg.model.model.layers[i].mlp
        y = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(inputs[i])) * mlp.stem_embedding.weight[ids[0]])
        assert body["ffn_norm"][row] == pytest.approx(y.norm(dim=-1).tolist(), rel=1e-4)
        assert len(body["grad_x_input"][row]) == ids.shape[1]


@torch.no_grad()
def test_nearest_tokens_by_row_cosine(client_for, stem_ckpt):
    client, pg = client_for(stem_ckpt)
    query = ids_of(" " + SOURCE)[0]
    status, body = post(client, "/api/nearest", token_id=query, k=4)
    assert status == 200 and [t["name"] for t in body["tables"]] == ["layer 1", "layer 2", "embed_tokens"]
    weight = pg.model.token_tables()[1].weight
    cos = (weight @ weight[query]) / (weight.norm(dim=-1) * weight[query].norm())
    cos[query] = -2
    expected = torch.topk(cos, 4)
    got = body["tables"][0]["neighbours"]
    assert [n["id"] for n in got] == expected.indices.tolist()
    assert [n["cosine"] for n in got] == pytest.approx(expected.values.tolist(), abs=1e-5)
    status, body = post(client, "/api/nearest", token_id=8192)
    assert status == 400 and "token_id must be between 0 and 8191" in body["error"]


def test_edits_default_to_the_editing_modules_pad(stem_ckpt):
    from stemlm.edit import DEFAULT_PAD, make_edit
    from stemlm.serve import EditSpec, Playground
    from stemlm.serve.editing import build_edit

    pg = Playground.load(stem_ckpt)
    ids = ids_of("The capital of United Kingdom is")  # a two-token source, a one-token target: padded
    edit = build_edit(pg.model, TOK, ids, EditSpec(source="United Kingdom", target="France", strategy="left_pad"))
    assert edit == make_edit(pg.model, TOK, ids, "United Kingdom", "France", strategy="left_pad", pad=DEFAULT_PAD)


def test_a_failure_inside_the_stream_arrives_as_an_error_event(client_for, stem_ckpt, monkeypatch):
    client, pg = client_for(stem_ckpt)

    def broken(ids, sampling):
        yield 1
        raise RuntimeError("boom")

    monkeypatch.setattr(pg, "stream", broken)
    evs = events(client.post("/api/generate", json={"prompt": PROMPT}))
    assert [kind for kind, _ in evs] == ["token", "error"]
    assert evs[-1][1] == {"error": "internal error (RuntimeError); see the server log"}
