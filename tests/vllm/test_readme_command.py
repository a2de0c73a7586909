"""The README's vLLM command, as written, serves the checkpoint folder `stemlm train` writes (training state beside
the weights) on loopback, with no environment variable set, and answers with `stemlm generate --greedy`'s tokens;
a chat request to this base model (its tokenizer has no chat template) gets vLLM's 400 that docs/vllm.md quotes.

The argv is read from README.md (`tests.vllm.server.readme_command`); docs/vllm.md must carry the same line.
"""

from __future__ import annotations

import os

import pytest

from stemlm.data.tokenizer import default_tokenizer
from tests.vllm.conftest import NEW_TOKENS, stemlm_greedy
from tests.vllm.server import ROOT, as_run_here, readme_command, running

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

PROMPT = "The capital of France is"
NO_TEMPLATE = "default chat template is no longer allowed"  # vLLM's 400 for a chat request without a template


def test_docs_vllm_md_carries_the_readme_command():
    assert readme_command(ROOT / "docs" / "vllm.md") == readme_command()


@pytest.fixture(scope="module")
def served(trained, tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU_KVCACHE")}  # the command sets it
    log = tmp_path_factory.mktemp("vllm-readme") / "server.log"
    with running(as_run_here(readme_command(), trained), log, env=env) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused"), log


def test_the_folder_holds_the_training_state(trained):
    assert (trained / "optimizer.safetensors").is_file() and (trained / "trainer_state.json").is_file()


def test_the_readme_command_answers_with_stemlm_greedy_tokens(served, trained):
    client, log = served
    ids = default_tokenizer().encode(PROMPT).ids
    reply = client.completions.create(
        model=str(trained), prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert reply.choices[0].prompt_token_ids == ids
    assert reply.choices[0].token_ids == stemlm_greedy(trained, [ids])[0]


def test_the_server_listens_on_loopback_only(served):
    _, log = served
    assert "Starting vLLM server on http://127.0.0.1:" in log.read_text()


def test_a_chat_request_to_a_base_model_gets_vllms_400(served, trained):
    client, _ = served
    with pytest.raises(openai.BadRequestError, match=NO_TEMPLATE):
        client.chat.completions.create(model=str(trained), messages=[{"role": "user", "content": "Hi"}])
