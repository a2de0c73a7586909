"""The one progress rule (`stemlm.progress`): a bar only when asked for and stderr is a terminal. Checked on the
shared helper, on the train bar (whose evaluation lines still go to stderr) and on `data prepare`, whose bars
printed regardless of the terminal before. Run: `python -m pytest tests/test_progress.py -q`."""

from __future__ import annotations

import io
import sys

from stemlm.cli.main import main
from stemlm.progress import RELAYED_TERMINAL, bar, shown
from stemlm.train.logging import RunLogger


def draw(progress: bool) -> None:
    with bar(3, progress=progress, desc="work", unit="step") as b:
        b.update(3)


def test_a_bar_is_drawn_on_a_terminal_unless_turned_off(tty_stderr):
    assert shown(True) and not shown(False)
    draw(True)
    assert tty_stderr.readouterr().err.strip().split("\r")[-1].startswith("work: 100%")
    draw(False)
    assert tty_stderr.readouterr().err == ""


def test_no_bar_on_a_stderr_that_is_not_a_terminal(capsys):
    assert not shown(True)
    draw(True)
    assert capsys.readouterr().err == ""


def test_a_stderr_relayed_to_a_terminal_draws_bars(capsys, monkeypatch):
    monkeypatch.setenv(RELAYED_TERMINAL, "1")
    assert shown(True) and not shown(False)


def test_train_nproc_tells_its_ranks_when_their_stderr_reaches_a_terminal(tty_stderr, monkeypatch):
    from stemlm.train.parallel.workers import run_torchrun

    monkeypatch.delenv(RELAYED_TERMINAL, raising=False)
    child = [sys.executable, "-c", f"import os, sys; sys.stderr.write(os.environ.get({RELAYED_TERMINAL!r}, 'no'))"]
    assert run_torchrun(child, io.BytesIO())[:2] == (0, "1")
    monkeypatch.setattr(type(sys.stderr), "isatty", lambda self: False)
    assert run_torchrun(child, io.BytesIO())[:2] == (0, "no")


def test_train_bar_follows_the_rule_and_keeps_its_messages(tmp_path, capsys):
    logger = RunLogger(tmp_path, 0, 5, progress=True)
    logger.advance(5.0, 10.0)
    logger.message("step 1: held-out loss 5.0")
    logger.close()
    assert capsys.readouterr().err == "step 1: held-out loss 5.0\n"


def test_data_prepare_bar_only_on_a_terminal(tmp_path, tty_stderr, monkeypatch):
    (tmp_path / "a.txt").write_text("one small document for the tokenizer")
    argv = ["data", "prepare", str(tmp_path / "a.txt"), "--workers", "1", "--json"]
    assert main([*argv, "--out", str(tmp_path / "tty")]) == 0
    assert "tokenizing: 100%" in tty_stderr.readouterr().err
    assert main([*argv, "--out", str(tmp_path / "quiet"), "--no-progress"]) == 0
    assert tty_stderr.readouterr().err == ""
    monkeypatch.setattr(type(sys.stderr), "isatty", lambda self: False)
    assert main([*argv, "--out", str(tmp_path / "pipe")]) == 0
    assert tty_stderr.readouterr().err == ""
