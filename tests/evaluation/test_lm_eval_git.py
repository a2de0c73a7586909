"""lm-eval records the working directory's git commit; outside a git checkout, and where git is not installed, an
evaluation prints nothing of git's (`stemlm.evaluation.lm_eval_adapter.quiet_git_hash`) and still runs.

stderr is captured at the file descriptor (`capfd`), where the git child process writes.
"""

from __future__ import annotations

import pytest

from stemlm.evaluation.lm_eval_adapter import StemlmLM, run_lm_eval


@pytest.mark.parametrize("git", ["present", "absent"])
def test_no_git_line_outside_a_checkout(lm_and_tok, tmp_path, monkeypatch, capfd, git):
    model, tok = lm_and_tok
    outside = tmp_path / "not-a-checkout"
    outside.mkdir()
    monkeypatch.chdir(outside)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # no checkout above it counts either
    if git == "absent":
        monkeypatch.setenv("PATH", str(tmp_path))  # a PATH without git
    results = run_lm_eval(StemlmLM(model, tok), limit=1)
    err = capfd.readouterr().err
    assert "fatal" not in err and "not a git repository" not in err, err
    assert results["git_hash"] is None
    assert results["results"]
