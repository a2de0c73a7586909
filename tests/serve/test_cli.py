"""`stemlm serve`: flags, one-line errors, and a real server process that answers (the page and /v1) and stops on
Ctrl-C."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

from stemlm.cli.main import build_parser, main


def test_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--tables", "--cache-rows", "--cache-fraction", "--cache-policy", "--save-dir"):
        assert flag in out


def test_defaults_are_loopback():
    args = build_parser().parse_args(["serve", "ckpt"])
    assert (args.host, args.port, args.tables, args.save_dir) == ("127.0.0.1", 7860, "resident", None)


def test_missing_checkpoint_is_a_one_line_error(capsys, tmp_path):
    assert main(["serve", str(tmp_path / "nope")]) == 2
    expected = f"stemlm serve: error: checkpoint or run folder {tmp_path / 'nope'} does not exist"
    assert capsys.readouterr().err.strip() == expected


def test_cache_flags_need_host_tables(capsys, stem_ckpt):
    assert main(["serve", str(stem_ckpt), "--cache-rows", "8"]) == 2
    assert "need --tables host" in capsys.readouterr().err


def test_port_in_use_is_a_one_line_error(capsys, stem_ckpt):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["serve", str(stem_ckpt), "--port", str(taken.getsockname()[1])]) == 2
    assert "try another --port" in capsys.readouterr().err


def test_server_process_answers_and_stops_on_interrupt(stem_ckpt):
    proc = subprocess.Popen(
        [sys.executable, "-m", "stemlm.cli.main", "serve", str(stem_ckpt), "--port", "0", "--tables", "host"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = None
        while url is None:
            line = proc.stderr.readline()
            assert line, "the server exited before announcing its address"
            match = re.search(r"at (http://127\.0\.0\.1:\d+/)", line)
            url = match.group(1) if match else None
        with urllib.request.urlopen(url + "api/info", timeout=60) as response:
            assert json.loads(response.read())["tables"] == "host"
        with urllib.request.urlopen(url, timeout=60) as response:
            page = response.read().decode()
        assert "stemlm playground" in page and "http" not in page.replace("http-equiv", "")  # nothing from a CDN
        with urllib.request.urlopen(url + "v1/models", timeout=60) as response:  # the API, from the same process
            assert [m["id"] for m in json.loads(response.read())["data"]] == [stem_ckpt.name]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert "stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_page_assets_load_nothing_from_elsewhere():
    from stemlm.serve.app import web_dir

    files = sorted(p.name for p in web_dir().iterdir())
    assert files == ["app.js", "index.html", "style.css"]
    for name in files:
        text = (web_dir() / name).read_text()
        assert "://" not in text and "@import" not in text and "url(" not in text, name
