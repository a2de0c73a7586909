"""`vllm serve` of a tiny STEM checkpoint answers the `openai` client with stemlm's greedy tokens, for a text prompt
and for a chat (the folder's tokenizer carries a ChatML template, rendered as `stemlm generate --chat` renders it),
and refuses a per-request edit (`edit`, or its old name `stem_edit`) with a 400 through
`stemlm.vllm.edits.RefuseEdits`.

One server for the module (started as a user starts it: `vllm serve CKPT --middleware ...`), on a free port.
"""

from __future__ import annotations

import pytest

from stemlm.data.tokenizer import default_tokenizer
from stemlm.inference.chat import load_chat
from tests.vllm.conftest import NEW_TOKENS, stemlm_greedy
from tests.vllm.server import running, serve_command

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    command = [
        *serve_command(checkpoints["stem"]), "--served-model-name", "tiny-stem", "--host", "127.0.0.1",
        "--dtype", "float32", "--kv-cache-memory-bytes", "1G", "--max-model-len", "256", "--max-num-seqs", "8",
        "--enforce-eager", "--middleware", "stemlm.vllm.edits.RefuseEdits",
    ]  # fmt: skip
    with running(command, tmp_path_factory.mktemp("vllm-serve") / "server.log") as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused")


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


def test_chat_completions_render_the_folders_template_as_stemlm_does(server, checkpoints):
    folder = checkpoints["stem"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = default_tokenizer().encode(load_chat(folder).render_messages(messages)).ids  # what `--chat` sends
    reply = server.chat.completions.create(
        model="tiny-stem", messages=messages, max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert reply.prompt_token_ids == ids
    assert reply.choices[0].token_ids == stemlm_greedy(folder, [ids])[0]
