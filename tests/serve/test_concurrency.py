"""Simultaneous requests against the real threaded server: each edit sees only its own rows, saves do not race.

The requests are made to overlap for certain: the playground's `edit` is wrapped so every request waits at a
barrier until all of them are inside it, and only then computes. Each answer must equal the answer the same
request got alone.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import torch

from .conftest import PROMPT

EDITS = [
    dict(prompt=PROMPT, source="France", target="Germany"),
    dict(prompt="Yesterday the king of Spain said", source="Spain", target="Italy"),
]


def call(url: str, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def run_together(jobs) -> list:
    results = [None] * len(jobs)

    def work(k):
        results[k] = jobs[k]()

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def gate_edits(pg, parties: int) -> dict:
    """Make `parties` edit requests wait for each other inside the playground; count how many overlapped."""
    barrier, seen = threading.Barrier(parties, timeout=60), {"max_inside": 0, "inside": 0}
    lock, original = threading.Lock(), pg.edit

    def gated(*args, **kwargs):
        with lock:
            seen["inside"] += 1
            seen["max_inside"] = max(seen["max_inside"], seen["inside"])
        barrier.wait()
        try:
            return original(*args, **kwargs)
        finally:
            with lock:
                seen["inside"] -= 1

    pg.edit = gated
    return seen


def test_two_simultaneous_edits_each_see_only_their_own(live_server, stem_ckpt):
    common = dict(max_new_tokens=5, greedy=True, show_top=5)
    with live_server(stem_ckpt) as (url, pg):
        alone = [call(url, "/api/edit", {**e, **common}) for e in EDITS]
        assert all(status == 200 for status, _ in alone)
        assert alone[0][1]["after"] != alone[1][1]["after"]
        seen = gate_edits(pg, 4)
        together = run_together([lambda e=e: call(url, "/api/edit", {**e, **common}) for e in EDITS * 2])
    assert seen["max_inside"] == 4
    for k, (status, body) in enumerate(together):
        expected = alone[k % 2][1]
        assert status == 200
        for key in ("positions", "before", "after", "max_abs_prob_change"):
            assert body[key] == expected[key], (k, key)


def test_saves_during_edits_leave_the_served_tables_alone(live_server, stem_ckpt, tmp_path):
    common = dict(max_new_tokens=3, greedy=True)
    with live_server(stem_ckpt, save_dir=tmp_path) as (url, pg):
        before = {i: t.weight.detach().clone() for i, t in pg.model.token_tables().items()}
        alone = call(url, "/api/edit", {**EDITS[1], **common})
        jobs = [lambda: call(url, "/api/edit", {**EDITS[1], **common}) for _ in range(2)]
        save = {**EDITS[0], "allow_shared_subwords": True}  # " France" is shared by "France's"
        jobs += [lambda n=n: call(url, "/api/save", {**save, "name": n}) for n in ("a", "a", "b")]
        results = run_together(jobs)
        for i, table in pg.model.token_tables().items():
            assert torch.equal(table.weight, before[i])
    timeless = [(status, {k: v for k, v in body.items() if k != "seconds"}) for status, body in [alone, *results[:2]]]
    assert timeless[1:] == [timeless[0]] * 2
    saves = sorted(status for status, _ in results[2:])
    assert saves == [200, 200, 409]  # the same name twice: exactly one wins, the other is refused
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]
