"""The README's vLLM command, as written, serves the checkpoint folder `stemlm train` writes (training state beside
the weights) on loopback, with no environment variable set and vLLM's default dtype, and is used as docs/vllm.md
says: it answers with `stemlm generate --greedy`'s tokens; a chat request to this base model (its tokenizer has no
chat template) gets vLLM's 400 that docs/vllm.md quotes; lm-eval's `local-completions` model (installed by stemlm's
`eval` extra) scores a task against it and against `stemlm serve` of the same run with per-request log-likelihoods
equal to float32 rounding and equal accuracies (docs/vllm.md's lm-eval command).

One server for the module. The argv is read from README.md (`tests.vllm.server.readme_command`); docs/vllm.md must
carry the same line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stemlm.data.tokenizer import default_tokenizer
from stemlm.evaluation.tasks import shipped_task_dir
from stemlm.serve.lm_eval_tokenizer import write_lm_eval_tokenizer
from tests.vllm.conftest import NEW_TOKENS, stemlm_greedy
from tests.vllm.server import ROOT, as_run_here, readme_command, running

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

PROMPT = "The capital of France is"
NO_TEMPLATE = "default chat template is no longer allowed"  # vLLM's 400 for a chat request without a template
TASK, LIMIT = "stemlm_facts_capital", 12


def test_docs_vllm_md_carries_the_readme_command():
    assert readme_command(ROOT / "docs" / "vllm.md") == readme_command()


def test_the_readme_command_passes_no_dtype():
    assert not any(arg.startswith("--dtype") for arg in readme_command())  # vLLM's default is what is tested


@pytest.fixture(scope="module")
def served(trained, tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU_KVCACHE")}  # the command sets it
    log = tmp_path_factory.mktemp("vllm-readme") / "server.log"
    with running(as_run_here(readme_command(), trained), log, env=env) as url:
        yield url, log


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused")


def test_the_folder_holds_the_training_state(trained):
    assert (trained / "optimizer.safetensors").is_file() and (trained / "trainer_state.json").is_file()


def test_the_readme_command_answers_with_stemlm_greedy_tokens(client, trained):
    ids = default_tokenizer().encode(PROMPT).ids
    reply = client.completions.create(
        model=str(trained), prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert reply.choices[0].prompt_token_ids == ids
    assert reply.choices[0].token_ids == stemlm_greedy(trained, [ids])[0]


def test_the_server_listens_on_loopback_only(served):
    assert "Starting vLLM server on http://127.0.0.1:" in served[1].read_text()


def test_a_chat_request_to_a_base_model_gets_vllms_400(client, trained):
    with pytest.raises(openai.BadRequestError, match=NO_TEMPLATE):
        client.chat.completions.create(model=str(trained), messages=[{"role": "user", "content": "Hi"}])


def lm_eval(url: str, model: str, tokenizer: Path, out: Path) -> list[dict]:
    """`lm_eval --model local-completions` on TASK against the server at `url`; its logged samples."""
    pytest.importorskip("lm_eval")
    args = (
        f"model={model},base_url={url}/v1/completions,tokenizer_backend=huggingface,tokenizer={tokenizer},"
        "add_bos_token=True,max_length=1024,num_concurrent=1"
    )
    command = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--tasks", TASK, "--include_path", "."]
    command += ["--limit", str(LIMIT), "--model_args", args, "--output_path", str(out), "--log_samples"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, cwd=shipped_task_dir(), env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (samples,) = out.rglob(f"samples_{TASK}_*.jsonl")
    return [json.loads(line) for line in samples.read_text().splitlines()]


def loglikelihoods(samples: list[dict]) -> list[float]:
    return [float(resp[0][0]) for sample in sorted(samples, key=lambda s: s["doc_id"]) for resp in sample["resps"]]


def test_lm_eval_scores_vllm_as_stemlm_serve(served, trained, tmp_path):
    run = trained.parent.parent  # served by stemlm under the run's name, "tiny"
    tokenizer = write_lm_eval_tokenizer(run, tmp_path / "tokenizer")
    by_vllm = lm_eval(served[0], str(trained), tokenizer, tmp_path / "vllm")
    stemlm_serve = [sys.executable, "-m", "stemlm.cli.main", "serve", str(run)]
    with running(stemlm_serve, tmp_path / "stemlm.log") as url:
        by_stemlm = lm_eval(url, run.name, tokenizer, tmp_path / "stemlm")
    assert len(by_vllm) == len(by_stemlm) == LIMIT
    assert loglikelihoods(by_vllm) == pytest.approx(loglikelihoods(by_stemlm), abs=1e-4)
    assert [s["acc"] for s in by_vllm] == [s["acc"] for s in by_stemlm]
