"""`vllm serve` of a tiny STEM checkpoint answers the `openai` client with stemlm's greedy tokens, and refuses a
per-request edit (`edit`, or its old name `stem_edit`) with a 400 through `stemlm.vllm.edits.RefuseEdits`.

One server for the module (started as a user starts it: `vllm serve CKPT --middleware ...`), on a free port.
"""

from __future__ import annotations

import importlib.metadata
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from stemlm.data.tokenizer import default_tokenizer
from tests.vllm.conftest import NEW_TOKENS, stemlm_greedy

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

START_S = 600  # a hung start fails the module after this long instead of stalling CI (not a speed bound)
PROMPT = "The capital of France is"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    command = [
        *serve_command(str(checkpoints["stem"])), "--served-model-name", "tiny-stem",
        "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32",
        "--max-model-len", "256", "--max-num-seqs", "8", "--enforce-eager",
        "--middleware", "stemlm.vllm.edits.RefuseEdits",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(process, port, log)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    finally:
        process.terminate()
        process.wait(timeout=60)


def serve_command(folder: str) -> list[str]:
    """`vllm serve FOLDER`; vllm-cpu 0.32.0's `vllm` script dies at start asking for the version of a distribution
    named "vllm" (it is installed as "vllm-cpu": PackageNotFoundError), so there the same server is started through
    its module, vLLM's older spelling of the command."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder]
    return [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", folder]


def wait_healthy(process: subprocess.Popen, port: int, log) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"vllm serve exited {process.returncode}:\n" + "\n".join(log.read_text().splitlines()[-30:]))
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return
        except OSError:
            time.sleep(2)
    pytest.fail(f"vllm serve did not answer /health within {START_S} s")


def test_openai_client_gets_stemlm_greedy_tokens(server, checkpoints):
    ids = default_tokenizer().encode(PROMPT).ids
    reply = server.completions.create(
        model="tiny-stem", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.prompt_token_ids == ids  # the tokenizer.json stemlm saved is the one vLLM read
    assert choice.token_ids == stemlm_greedy(checkpoints["stem"], [ids])[0]
    assert choice.text == default_tokenizer().decode(choice.token_ids)
    assert reply.model == "tiny-stem" and reply.usage.completion_tokens == NEW_TOKENS


@pytest.mark.parametrize("field", ["edit", "stem_edit"])
def test_a_per_request_edit_is_refused_with_the_reason(server, field):
    edit = {"source": "France", "target": "Italy"}
    with pytest.raises(openai.BadRequestError) as refused:
        server.completions.create(model="tiny-stem", prompt=PROMPT, max_tokens=4, extra_body={field: edit})
    assert f"per-request edits ({field}) are not supported by vLLM" in str(refused.value)


def test_a_request_without_an_edit_passes_the_middleware_unchanged(server):
    # the middleware reads the body to look for an edit; vLLM must still get all of it (its own checks run)
    with pytest.raises(openai.BadRequestError) as refused:
        server.completions.create(model="tiny-stem", prompt=PROMPT, max_tokens=4, temperature=-1)
    assert "temperature" in str(refused.value)
