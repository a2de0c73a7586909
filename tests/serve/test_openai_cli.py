"""`stemlm server` (the alias of `stemlm serve`) as a process: it serves on the port it prints, and SIGTERM shuts
it down gracefully (the stream in flight finishes, the process exits 0)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serve.conftest import PROMPT
from tests.serve.openai_helpers import http_request

openai = pytest.importorskip("openai")
SRC = Path(__file__).resolve().parents[2] / "src"


def test_server_process_serves_and_stops_gracefully(chat_ckpt, reference):
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    argv = [
        sys.executable,
        "-m",
        "stemlm.cli.main",
        "server",
        str(chat_ckpt),
        "--port",
        "0",
        "--slots",
        "2",
        "--no-compile",
    ]
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        url = re.search(r"at (http://\S+)/v1", line).group(1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        out = client.completions.create(model=chat_ckpt.name, prompt=PROMPT, max_tokens=8, temperature=0)
        assert out.choices[0].text == reference(PROMPT, 8)
        body = {"model": chat_ckpt.name, "prompt": PROMPT, "max_tokens": 60, "temperature": 0, "stream": True}
        response = http_request(url, "POST", "/v1/completions", body)
        assert response.readline().startswith(b"data: ")  # the stream has started
        proc.send_signal(signal.SIGTERM)
        rest = response.read().decode()
        assert rest.rstrip().endswith("data: [DONE]")  # it finished instead of being cut
        assert proc.wait(timeout=60) == 0
        assert "stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
