"""`vllm serve` of a tiny STEM checkpoint, the folder `stemlm export --remote-code` wrote, in float32 with its tables
selected for vLLM's UVA host offload (`--cpu-offload-params stem_embedding`): the `openai` client gets
`stemlm generate --greedy`'s tokens prompt by prompt and for several prompts in one request (one batch), for a text
prompt and for a chat (the folder's tokenizer carries a ChatML template, rendered as `stemlm generate --chat`
renders it); a per-request edit (`edit`, or its old name `stem_edit`) is refused with a 400 through
`stemlm.vllm.edits.RefuseEdits`.

One server for the module (started as a user starts it: `vllm serve CKPT --middleware ...`), on a free port. On a
CPU the offload is a no-op (vLLM leaves parameters that are in host memory already where they are), so this checks
that the option is accepted and changes nothing; the GPU line of benchmarks/gpu_check.sh runs it where it moves the
tables.
"""

from __future__ import annotations

import pytest

from stemlm.data.tokenizer import default_tokenizer
from stemlm.inference.chat import load_chat
from tests.vllm.conftest import NEW_TOKENS, PROMPTS, stemlm_greedy
from tests.vllm.server import running, serve_command

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

PROMPT = "The capital of France is"
NAME = "tiny-stem"
GREEDY = dict(max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})


@pytest.fixture(scope="module")
def served(checkpoints, tmp_path_factory):
    command = [
        *serve_command(checkpoints["stem-export"]), "--served-model-name", NAME, "--host", "127.0.0.1",
        "--dtype", "float32", "--kv-cache-memory-bytes", "1G", "--max-model-len", "256", "--max-num-seqs", "8",
        "--enforce-eager", "--cpu-offload-gb", "1", "--cpu-offload-params", "stem_embedding",
        "--middleware", "stemlm.vllm.edits.RefuseEdits",
    ]  # fmt: skip
    log = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    with running(command, log) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused"), log


@pytest.fixture
def server(served):
    return served[0]


def served_greedy(client, prompts: list[list[int]]) -> list[list[int]]:
    """The greedy tokens of token-id prompts sent in one completions request (vLLM schedules them as one batch)."""
    reply = client.completions.create(model=NAME, prompt=prompts, **GREEDY)
    return [choice.token_ids for choice in sorted(reply.choices, key=lambda c: c.index)]


def test_the_plugins_architecture_serves_with_the_tables_selected_for_offload(served):
    log = served[1].read_text()
    assert "Resolved architecture: StemlmForCausalLM" in log
    assert "'cpu_offload_params': ['stem_embedding']" in log  # vLLM's "non-default args" line


def test_greedy_tokens_equal_stemlm_prompt_by_prompt(server, checkpoints):
    assert [served_greedy(server, [p])[0] for p in PROMPTS] == stemlm_greedy(checkpoints["stem"])


def test_greedy_tokens_equal_stemlm_in_one_batch(server, checkpoints):
    assert served_greedy(server, PROMPTS) == stemlm_greedy(checkpoints["stem"])


def test_openai_client_gets_stemlm_greedy_tokens_for_text(server, checkpoints):
    ids = default_tokenizer().encode(PROMPT).ids
    reply = server.completions.create(model=NAME, prompt=PROMPT, **GREEDY)
    choice = reply.choices[0]
    assert choice.prompt_token_ids == ids  # the tokenizer.json stemlm saved is the one vLLM read
    assert choice.token_ids == stemlm_greedy(checkpoints["stem"], [ids])[0]
    assert choice.text == default_tokenizer().decode(choice.token_ids)
    assert reply.model == NAME and reply.usage.completion_tokens == NEW_TOKENS


@pytest.mark.parametrize("field", ["edit", "stem_edit"])
def test_a_per_request_edit_is_refused_with_the_reason(server, field):
    edit = {"source": "France", "target": "Italy"}
    with pytest.raises(openai.BadRequestError) as refused:
        server.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, extra_body={field: edit})
    assert f"per-request edits ({field}) are not supported by vLLM" in str(refused.value)


def test_a_request_without_an_edit_passes_the_middleware_unchanged(server):
    # the middleware reads the body to look for an edit; vLLM must still get all of it (its own checks run)
    with pytest.raises(openai.BadRequestError) as refused:
        server.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=-1)
    assert "temperature" in str(refused.value)


def test_chat_completions_render_the_folders_template_as_stemlm_does(server, checkpoints):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    template = load_chat(checkpoints["stem-export"])  # the template of the folder served
    ids = default_tokenizer().encode(template.render_messages(messages)).ids  # what `--chat` sends
    reply = server.chat.completions.create(model=NAME, messages=messages, **GREEDY)
    assert reply.prompt_token_ids == ids
    assert reply.choices[0].token_ids == stemlm_greedy(checkpoints["stem"], [ids])[0]
