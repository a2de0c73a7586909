"""lm-eval's `local-completions` model (installed by stemlm's `eval` extra) scores the same task against vLLM
serving a `stemlm train` checkpoint and against `stemlm serve` of the same run: per-request log-likelihoods agree to
float32 rounding and the accuracies are equal. The command is docs/vllm.md's (lm-eval against vLLM).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stemlm.evaluation.tasks import shipped_task_dir
from stemlm.serve.lm_eval_tokenizer import write_lm_eval_tokenizer
from tests.vllm.server import running, serve_command

pytest.importorskip("vllm")
pytest.importorskip("lm_eval")

TASK, LIMIT = "stemlm_facts_capital", 12
VLLM_FLAGS = ["--served-model-name", "tiny", "--host", "127.0.0.1", "--dtype", "float32"]
VLLM_FLAGS += ["--kv-cache-memory-bytes", "1G", "--enforce-eager"]


def lm_eval(url: str, tokenizer: Path, out: Path) -> list[dict]:
    """`lm_eval --model local-completions` on TASK against the server at `url`; its logged samples."""
    args = (
        f"model=tiny,base_url={url}/v1/completions,tokenizer_backend=huggingface,tokenizer={tokenizer},"
        "add_bos_token=True,max_length=1024,num_concurrent=1"
    )
    command = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--tasks", TASK, "--include_path", "."]
    command += ["--limit", str(LIMIT), "--model_args", args, "--output_path", str(out), "--log_samples"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, cwd=shipped_task_dir(), env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (samples,) = out.rglob(f"samples_{TASK}_*.jsonl")
    return [json.loads(line) for line in samples.read_text().splitlines()]


def stemlm_serve(run: Path, log: Path):
    return running([sys.executable, "-m", "stemlm.cli.main", "serve", str(run)], log)


def loglikelihoods(samples: list[dict]) -> list[float]:
    return [float(resp[0][0]) for sample in sorted(samples, key=lambda s: s["doc_id"]) for resp in sample["resps"]]


def test_lm_eval_scores_vllm_as_stemlm_serve(trained, tmp_path):
    run = trained.parent.parent  # served by stemlm under the run's name, "tiny"
    tokenizer = write_lm_eval_tokenizer(run, tmp_path / "tokenizer")
    with running([*serve_command(trained), *VLLM_FLAGS], tmp_path / "vllm.log") as url:
        by_vllm = lm_eval(url, tokenizer, tmp_path / "vllm")
    with stemlm_serve(run, tmp_path / "stemlm.log") as url:
        by_stemlm = lm_eval(url, tokenizer, tmp_path / "stemlm")
    assert len(by_vllm) == len(by_stemlm) == LIMIT
    assert loglikelihoods(by_vllm) == pytest.approx(loglikelihoods(by_stemlm), abs=1e-4)
    assert [s["acc"] for s in by_vllm] == [s["acc"] for s in by_stemlm]
