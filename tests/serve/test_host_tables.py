"""`stemlm serve --tables host`: generation through the row cache with its statistics, edits through the host view."""

from __future__ import annotations

import json
import threading

from .conftest import PROMPT, SOURCE, TARGET


def stream_ids(client, **body) -> tuple[list[int], dict]:
    response = client.post("/api/generate", json={"prompt": PROMPT, "greedy": True, **body})
    frames = [f for f in response.get_data(as_text=True).split("\n\n") if f.strip()]
    parsed = [(f.splitlines()[0][len("event: ") :], json.loads(f.splitlines()[1][len("data: ") :])) for f in frames]
    tokens = [d["id"] for k, d in parsed if k == "token" and d["id"] is not None]
    return tokens, parsed[-1][1]


def test_host_tables_generate_like_resident_and_report_the_cache(client_for, stem_ckpt):
    resident, _ = client_for(stem_ckpt)
    host, pg = client_for(stem_ckpt, tables="host", cache_rows=16)
    expected, _ = stream_ids(resident, max_new_tokens=6)
    tokens, done = stream_ids(host, max_new_tokens=6)
    assert tokens == expected
    cache = done["cache"]["cache"]
    assert done["cache"]["placement"] == "host" and done["cache"]["cache_rows"] == 16
    # one prefill step for the prompt, then one per token fed back (the last sampled token is never fed)
    assert cache["steps"] == 1 + 5 and cache["lookups"] == len(pg.encode(PROMPT)) + 5
    assert cache["hits"] + cache["misses"] == cache["unique_ids"] > 0
    assert host.get("/api/stats").get_json()["cache"]["cache"]["steps"] == cache["steps"]
    assert resident.get("/api/stats").get_json() == {"cache": None}


def test_host_tables_edit_and_analyse_like_resident(client_for, stem_ckpt):
    resident, _ = client_for(stem_ckpt)
    host, pg = client_for(stem_ckpt, tables="host", cache_fraction=0.01)
    assert host.get("/api/info").get_json()["tables"] == "host"
    body = dict(prompt=PROMPT, source=SOURCE, target=TARGET, max_new_tokens=4, greedy=True)
    edited = [client.post("/api/edit", json=body).get_json()["after"] for client in (host, resident)]
    assert edited[0] == edited[1]
    a = host.post("/api/contribution", json={"prompt": PROMPT}).get_json()
    b = resident.post("/api/contribution", json={"prompt": PROMPT}).get_json()
    assert a["ffn_norm"] == b["ffn_norm"] and a["predicted"] == b["predicted"]
    assert pg.offloaded.stats().steps == 0  # editing and analysis never went through the row cache


def test_abandoned_stream_does_not_break_the_next(client_for, stem_ckpt):
    _, pg = client_for(stem_ckpt, tables="host", cache_rows=8)
    sampling = dict(max_new_tokens=6, greedy=True, temperature=1.0, top_k=0, top_p=1.0, seed=0)
    full = list(pg.stream(pg.encode(PROMPT), sampling))
    partial = pg.stream(pg.encode(PROMPT), sampling)
    assert next(partial) == full[0]
    partial.close()  # a client that disconnected after the first token
    assert list(pg.stream(pg.encode(PROMPT), sampling)) == full


def test_concurrent_host_generations_take_turns(client_for, stem_ckpt):
    client, _ = client_for(stem_ckpt, tables="host", cache_rows=8)
    expected, _ = stream_ids(client, max_new_tokens=5)
    results = [None] * 3

    def work(k):
        results[k] = stream_ids(client, max_new_tokens=5)[0]

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [expected] * 3


def test_host_tables_save_the_same_checkpoint(client_for, stem_ckpt, tmp_path):
    import torch

    from stemlm.checkpoint.folder import read_state

    body = dict(prompt=PROMPT, source=SOURCE, target=TARGET, strategy="average", allow_shared_subwords=True)
    for tables in ("host", "resident"):
        client, _ = client_for(stem_ckpt, tables=tables, save_dir=tmp_path)
        assert client.post("/api/save", json={**body, "name": tables}).status_code == 200
    host, resident = read_state(tmp_path / "host"), read_state(tmp_path / "resident")
    assert host.keys() == resident.keys() and all(torch.equal(host[k], resident[k]) for k in host)
    assert not torch.equal(
        host["model.layers.1.mlp.stem_embedding.weight"],
        read_state(stem_ckpt)["model.layers.1.mlp.stem_embedding.weight"],
    )
