"""lm-evaluation-harness's `local-completions` model against a `stemlm serve` process scores a shipped task exactly
as `stemlm eval lm` does: the command docs/serving.md shows (lm-eval tokenizing with `write_lm_eval_tokenizer`'s
folder and sending ids, the server echoing their log-probabilities), on a run folder served under the run's name.

lm-eval's API models need its `api` extra (`tenacity`); the test skips without it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from stemlm.evaluation.tasks import shipped_task_dir
from stemlm.serve.lm_eval_tokenizer import write_lm_eval_tokenizer

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity", reason="lm-eval's API models need lm-eval[api] (tenacity)")

TASK, LIMIT = "stemlm_facts_capital", 20


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    from stemlm.checkpoint.folder import save_pretrained
    from tests.evaluation.conftest import small_model

    run = tmp_path_factory.mktemp("lm-eval") / "tiny"
    model, tokenizer = small_model()
    save_pretrained(model, run / "checkpoints" / "step-000300", tokenizer=tokenizer)
    return run


def serve(run: Path) -> tuple[subprocess.Popen, str]:
    """`stemlm serve RUN --port 0` in its own process; (the process, its base URL) once it listens."""
    command = [sys.executable, "-m", "stemlm.cli.main", "serve", str(run), "--port", "0", "--no-compile"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    for line in process.stderr:
        found = re.search(r"(http://\S+)/v1 ", line)
        if found:  # the rest of its log is read (and dropped) so that a full pipe never blocks the server
            threading.Thread(target=process.stderr.read, daemon=True).start()
            return process, found.group(1)
    process.wait()
    raise AssertionError(f"stemlm serve exited with {process.returncode} before listening")


def test_lm_eval_local_completions_matches_stemlm_eval_lm(run_folder, tmp_path):
    from stemlm.evaluation.lm_eval_adapter import evaluate_checkpoint, summarize_results
    from stemlm.inference.load import InferenceOptions

    tokenizer = write_lm_eval_tokenizer(run_folder, tmp_path / "tokenizer")
    process, url = serve(run_folder)
    try:
        args = (
            f"model=tiny,base_url={url}/v1/completions,tokenizer_backend=huggingface,tokenizer={tokenizer},"
            "add_bos_token=True,max_length=96,num_concurrent=1"
        )
        command = [str(Path(sys.executable).parent / "lm_eval"), "--model", "local-completions", "--tasks", TASK]
        command += ["--include_path", ".", "--limit", str(LIMIT), "--model_args", args]
        command += ["--output_path", str(tmp_path / "out")]
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
        if not shutil.which(command[0]):
            command[:1] = [sys.executable, "-m", "lm_eval"]
        done = subprocess.run(command, cwd=shipped_task_dir(), env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
    finally:
        process.terminate()
        process.wait(30)
    (results_file,) = (tmp_path / "out").rglob("results_*.json")
    served = summarize_results(json.loads(results_file.read_text()))[TASK]
    direct = evaluate_checkpoint(
        run_folder, InferenceOptions(device="cpu", dtype="fp32"), [TASK], limit=LIMIT, progress=False
    )
    expected = summarize_results(direct)[TASK]
    assert served == pytest.approx(expected, abs=1e-9) and set(served) == {"acc", "acc_norm"}
    assert 0 < served["acc"] < 1  # neither all right nor all wrong: the match says something
