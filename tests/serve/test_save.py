"""Saving a global edit from the playground: a new checkpoint under --save-dir, the served model untouched, and
the CLI's rule (`edit --save`): an edit whose changed tokens other words share needs `allow_shared_subwords`.

" France" is one token that "France's" shares (so saving it needs the opt-in); " Ireland" is shared by no
reference word (so it saves without)."""

from __future__ import annotations

import json

import pytest
import torch

from stemlm.checkpoint.runs import from_pretrained
from stemlm.data.tokenizer import default_tokenizer
from stemlm.errors import StemlmError
from stemlm.serve import Playground

from .conftest import PROMPT, SOURCE, TARGET

TOK = default_tokenizer()


def ids_of(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False).ids


def test_save_writes_the_global_edit_and_leaves_the_served_model(client_for, stem_ckpt, tmp_path):
    client, pg = client_for(stem_ckpt, save_dir=tmp_path / "saved")
    served = {i: t.weight.detach().clone() for i, t in pg.model.token_tables().items()}
    body = dict(
        prompt=PROMPT,
        source=SOURCE,
        target=TARGET,
        strategy="average",
        layers=[2],
        name="fr-de",
        allow_shared_subwords=True,
    )
    response = client.post("/api/save", json=body)
    assert response.status_code == 200, response.get_json()
    body = response.get_json()
    assert body["path"] == str((tmp_path / "saved" / "fr-de").resolve())
    assert body["edit"]["source"] == SOURCE and body["edit"]["layers"] == [2] and body["edit"]["pad"] == "source"

    saved = from_pretrained(body["path"])
    original = from_pretrained(stem_ckpt)
    (src,) = ids_of(" " + SOURCE)
    tgt = ids_of(" " + TARGET)
    for i, table in saved.token_tables().items():
        expected = original.token_tables()[i].weight.detach().clone()
        if i == 2:  # average: the one source token takes the mean of the target's three rows
            expected[src] = expected[tgt].float().mean(0)
        torch.testing.assert_close(table.weight, expected, rtol=0, atol=1e-6)
        assert torch.equal(pg.model.token_tables()[i].weight, served[i])  # served tables unchanged
    for name, tensor in original.state_dict().items():
        if "stem_embedding" not in name:
            assert torch.equal(saved.state_dict()[name], tensor), name
    assert json.loads((tmp_path / "saved" / "fr-de" / "edits.json").read_text())["edits"][0]["target"] == TARGET
    assert (tmp_path / "saved" / "fr-de" / "tokenizer.json").is_file()


def test_save_from_a_picked_span(client_for, stem_ckpt, tmp_path):
    client, _ = client_for(stem_ckpt, save_dir=tmp_path)
    pos = ids_of(PROMPT).index(ids_of(" " + SOURCE)[0])
    body = dict(prompt=PROMPT, span=[pos, pos + 1], target=TARGET, name="span", allow_shared_subwords=True)
    response = client.post("/api/save", json=body)
    assert response.status_code == 200 and response.get_json()["edit"]["source"] == SOURCE


def test_save_of_shared_subwords_is_refused_until_allowed(client_for, stem_ckpt, tmp_path):
    client, _ = client_for(stem_ckpt, save_dir=tmp_path)
    body = dict(prompt=PROMPT, source=SOURCE, target=TARGET, name="fr-de")
    for refused in (body, {**body, "allow_shared_subwords": False}):
        response = client.post("/api/save", json=refused)
        assert response.status_code == 409
        answer = response.get_json()
        (changed,) = answer["changed_tokens"]
        assert changed == {"id": ids_of(" " + SOURCE)[0], "token": "ĠFrance", "shared_with": ["France's"]}
        assert "'ĠFrance' also in 1 words (France's)" in answer["error"] and "allow_shared_subwords" in answer["error"]
        assert list(tmp_path.iterdir()) == []  # nothing written
    response = client.post("/api/save", json={**body, "allow_shared_subwords": True})
    assert response.status_code == 200
    assert response.get_json()["edit"]["changed_tokens"] == [changed]
    assert (tmp_path / "fr-de" / "edits.json").is_file()


def test_cli_and_api_refuse_the_same_tokens(client_for, stem_ckpt, tmp_path, capsys):
    from stemlm.cli.main import main

    client, _ = client_for(stem_ckpt, save_dir=tmp_path)
    prompt = "The capital of Spain is"
    api = client.post("/api/save", json=dict(prompt=prompt, source="Spain", target=TARGET, name="es")).get_json()
    code = main(["edit", str(stem_ckpt), "--source", "Spain", "--target", TARGET, "--save", str(tmp_path / "cli")])
    cli = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "cli").exists() and list(tmp_path.iterdir()) == []
    listed = "a saved (global) edit rewrites these tokens' rows in every text: "
    assert cli.split(listed)[1].split("; pass --allow")[0] == api["error"].split(listed)[1].split("; confirm")[0]
    assert [t["token"] for t in api["changed_tokens"]] == ["ĠSp", "ain"]


def test_save_of_unshared_tokens_needs_no_opt_in(client_for, stem_ckpt, tmp_path):
    client, _ = client_for(stem_ckpt, save_dir=tmp_path)
    body = dict(prompt="The capital of Ireland is", source="Ireland", target=TARGET, name="ie")
    response = client.post("/api/save", json=body)
    assert response.status_code == 200, response.get_json()
    assert [t["shared_with"] for t in response.get_json()["edit"]["changed_tokens"]] == [[]]


def test_allow_shared_subwords_must_be_a_boolean(client_for, stem_ckpt, tmp_path):
    client, _ = client_for(stem_ckpt, save_dir=tmp_path)
    body = dict(prompt=PROMPT, source=SOURCE, target=TARGET, name="x", allow_shared_subwords="yes")
    response = client.post("/api/save", json=body)
    assert response.status_code == 400 and "allow_shared_subwords must be true or false" in response.get_json()["error"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "name, status, message",
    [
        ("taken", 409, "already exists"),
        ("../escape", 400, "no slashes"),
        (".hidden", 400, "use letters"),
        ("", 400, "name is empty"),
    ],
)
def test_bad_save_names(client_for, stem_ckpt, tmp_path, name, status, message):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    client, _ = client_for(stem_ckpt, save_dir=tmp_path)
    response = client.post("/api/save", json=dict(prompt=PROMPT, source=SOURCE, target=TARGET, name=name))
    assert response.status_code == status and message in response.get_json()["error"]
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_saving_needs_a_save_dir(client_for, stem_ckpt):
    client, _ = client_for(stem_ckpt)
    response = client.post("/api/save", json=dict(prompt=PROMPT, source=SOURCE, target=TARGET, name="x"))
    assert response.status_code == 400 and "--save-dir" in response.get_json()["error"]


def test_save_dir_cannot_be_the_served_checkpoint(stem_ckpt):
    with pytest.raises(StemlmError, match="served checkpoint itself"):
        Playground.load(stem_ckpt, save_dir=stem_ckpt)


def test_save_of_a_dense_checkpoint_is_refused(client_for, dense_ckpt, tmp_path):
    client, _ = client_for(dense_ckpt, save_dir=tmp_path)
    response = client.post("/api/save", json=dict(prompt=PROMPT, source=SOURCE, target=TARGET, name="d"))
    assert response.status_code == 400 and "no STEM tables" in response.get_json()["error"]
    assert list(tmp_path.iterdir()) == []
