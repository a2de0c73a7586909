"""`stemlm serve` load options shared with generate / eval (`stemlm.inference.load`): `--dtype` autocast on the
request threads, mmap tables, and compact (`--table-dtype`) rows."""

from __future__ import annotations

import threading

import pytest
import torch

from stemlm.checkpoint.runs import from_pretrained
from stemlm.cli.main import main
from stemlm.serve import Playground
from tests.serve.conftest import PROMPT

SAMPLING = {"max_new_tokens": 5, "greedy": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 0}


def test_dtype_bf16_runs_every_forward_under_autocast_on_any_thread(client_for, stem_ckpt):
    client, pg = client_for(stem_ckpt, dtype="bf16")
    assert client.get("/api/info").get_json()["autocast_dtype"] == "bfloat16"
    ids = torch.tensor([pg.encode(PROMPT)])
    out = {}
    worker = threading.Thread(target=lambda: out.update(logits=pg.served.model(ids).logits))  # autocast: per thread
    worker.start()
    worker.join()
    reference = from_pretrained(stem_ckpt).eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(ids).logits
    assert out["logits"].dtype == torch.bfloat16 and torch.equal(out["logits"].detach(), expected)
    _, fp32 = client_for(stem_ckpt)
    assert fp32.autocast_dtype == torch.float32 and fp32.served.model(ids).logits.dtype == torch.float32


def test_mmap_int8_tables_serve_what_resident_int8_rows_give(client_for, stem_ckpt, tmp_path):
    int8 = tmp_path / "int8"
    assert main(["convert", str(stem_ckpt), "--table-dtype", "int8", "--out", str(int8)]) == 0
    ids = Playground.load(stem_ckpt).encode(PROMPT)
    _, resident = client_for(stem_ckpt, table_dtype="int8")  # fp32 checkpoint, rows rounded through int8
    client, mapped = client_for(int8, tables="mmap", cache_rows=8)
    info = client.get("/api/info").get_json()
    assert info["tables"] == "mmap" and "read the tables directly" in info["editing"]
    assert list(mapped.stream(ids, SAMPLING)) == list(resident.stream(ids, SAMPLING))
    assert mapped.cache_report()["table_bytes"] == mapped.offloaded.provider.vocab_size * (2 * 128 + 2 * 4)
    _, host = client_for(int8, tables="host", cache_rows=8)  # int8 host rows: no editing view either
    assert "table-dtype" in host.info()["editing"]
    with pytest.raises(Exception, match="--tables mmap reads the rows in the format the checkpoint stores"):
        Playground.load(stem_ckpt, tables="mmap", table_dtype="int8")
