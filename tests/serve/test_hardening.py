"""The playground refuses what it should: foreign Host headers (DNS rebinding), bodies nested too deep, ports out of
range; and a contribution request sees only its own forward while another thread runs the same model."""

from __future__ import annotations

import threading

import pytest
import torch

from stemlm.analysis.attribution import attribute
from stemlm.cli.main import main
from stemlm.serve.hosts import trusted_hosts

from .conftest import PROMPT


@pytest.mark.parametrize(
    "host, status",
    [("localhost:7860", 200), ("127.0.0.1:7860", 200), ("[::1]:7860", 200), ("evil.example:7860", 400), ("x", 400)],
)
def test_only_loopback_host_headers_by_default(client_for, stem_ckpt, host, status):
    client, _ = client_for(stem_ckpt)
    assert client.get("/api/info", headers={"Host": host}).status_code == status
    assert client.get("/", headers={"Host": host}).status_code == status  # the page too


def test_allow_host_adds_names(client_for, stem_ckpt):
    client, _ = client_for(stem_ckpt, hosts=["lab.example"])
    assert client.get("/api/info", headers={"Host": "lab.example:7860"}).status_code == 200
    assert client.get("/api/info", headers={"Host": "0.0.0.0:7860"}).status_code == 400
    assert trusted_hosts("192.168.1.5") == ["localhost", "127.0.0.1", "[::1]", "192.168.1.5"]


def test_deeply_nested_body_is_a_400(client_for, stem_ckpt):
    client, _ = client_for(stem_ckpt)
    deep = "[" * 100_000 + "]" * 100_000
    reply = client.post("/api/tokenize", data=deep, content_type="application/json")
    assert reply.status_code == 400 and "nested too deeply" in reply.get_json()["error"]


@pytest.mark.parametrize("port", ["-1", "70000", "http"])
def test_port_out_of_range_is_an_argparse_error(capsys, stem_ckpt, port):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(stem_ckpt), "--port", port, "--no-compile"])
    assert exit_info.value.code == 2 and "--port" in capsys.readouterr().err


def test_contribution_ignores_another_threads_forward(stem_ckpt):
    """Another request's decode step runs on the shared model in the middle of the attribution's forward."""
    from stemlm.checkpoint.runs import load_checkpoint

    model, tok = load_checkpoint(stem_ckpt)
    ids = tok.encode(PROMPT).ids
    alone = attribute(model, ids)
    other = torch.tensor([tok.encode("A different, longer request from another user").ids])
    fired = []

    def interleave(_module, _inputs):  # on the final norm: after every layer's FFN hook of this forward
        if threading.current_thread() is threading.main_thread() and not fired:
            fired.append(True)
            worker = threading.Thread(target=lambda: model(other))
            worker.start()
            worker.join()

    handle = model.model.norm.register_forward_pre_hook(interleave)
    try:
        raced = attribute(model, ids)
    finally:
        handle.remove()
    assert fired and raced == alone
