"""Chat templates are untrusted (they come with a GGUF or a downloaded tokenizer_config.json): a template that
would allocate without end, loop for days or recurse is one clear error, from the API, from `generate --chat`
(exit 2, one line) and from the playground (HTTP 400), and ordinary templates render as before.

The bounds are `stemlm.inference.template_sandbox`'s. No wall-clock assertion here: each bomb is refused before
its work is done (the refusals come within a second on an idle core); a regression would show as a test that
hangs or is killed for memory, so the memory one checks the peak resident size as well.
"""

from __future__ import annotations

import json
import resource

import pytest

from stemlm.checkpoint.folder import save_pretrained
from stemlm.data.tokenizer import default_tokenizer
from stemlm.errors import StemlmError
from stemlm.inference.chat import ChatTemplate
from stemlm.model import build_model
from tests.bad_input import refuse
from tests.conftest import make_tiny_config
from tests.serve.conftest import client_for  # noqa: F401 (fixture)

NESTED = (  # 10**15 iterations
    "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}"
    "{% endfor %}{% endfor %}{% endfor %}"
)
BOMBS = [
    ("{{ 'x' * 10**10 }}", "repeating 1 items 10,000,000,000 times"),
    ("{{ 'x' * 10000000000 }}", "repeating 1 items"),  # a literal: not folded at compile time either
    ("{{ ([1] * 100000000)|length }}", "repeating 1 items 100,000,000 times"),
    (NESTED, "ran more than 1,000,000 steps"),
    ("{% macro f(n) %}{% for i in range(9999) %}{{ f(n - 1) if n }}{% endfor %}{% endmacro %}{{ f(3) }}", "steps"),
    ("{{ 10**100000000 }}", "too large an integer"),
    ("{{ 'x'|center(10000000000) }}", "center() was given 10,000,000,000"),
    ("{{ 'x'.ljust(10**10) }}", "ljust() was given"),
    ("{{ 'x'.zfill(10**9) }}", "zfill() was given"),
    ("{{ '%10000000000s' % 'x' }}", "a format string asks for a width over"),
    ("{{ '%*s' % (10**10, 'x') }}", "format() was given"),
    ("{{ '{:>10000000000}'.format('x') }}", "a format string asks for a width over"),
    ("{{ '{a:>99999999999}'.format_map({'a': 1}) }}", "a format string asks for a width over"),
    ("{{ '%10000000000s'|format('x') }}", "a format string asks for a width over"),
    ("{{ ('x' * 1000000)|replace('', 'y' * 1000) }}", "replace() could build"),
    ("{{ ('x' * 1000000)|indent(1000) }}", "indent() could build"),
    ("{{ (['x' * 1000000] * 100000)|join }}", "join() could build"),
    ("{{ ''.join(['x' * 1000000] * 100000) }}", "join() could build"),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "a value"),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "a value"),
    ("{% set b = 'x' * 4000000 %}{% set t %}{% for i in range(9) %}{{ b }}{% endfor %}{% endset %}{{ t }}", "a text"),
    ("{% set b = 'x' * 4000000 %}{% for i in range(100000) %}{{ b }}{% endfor %}", "the rendered prompt exceeds"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    ("{{ 1 + 'a' }}", "TypeError: unsupported operand"),
    ("{{ messages[99]['content'] }}", "failed"),
    ("{% for %}", "Expected an expression"),
    ("{{ raise_exception('no system role') }}", "no system role"),
    ("{{ ''.__class__.__mro__ }}", "failed"),
    ("x" * (2**20 + 1), "the template is 1,048,577 characters long"),
]


@pytest.mark.parametrize(("template", "message"), BOMBS)
def test_a_hostile_template_is_one_error(template, message):
    with pytest.raises(StemlmError, match="the checkpoint's chat template failed: ") as info:
        ChatTemplate(template, None, None).render("hi")
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_a_ten_gigabyte_repeat_allocates_nothing():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with pytest.raises(StemlmError):
        ChatTemplate("{{ 'x' * 10**10 }}", None, None).render("hi")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 512 * 1024


def test_an_ordinary_template_still_renders():
    template = (
        "{% set ns = namespace(first=true) %}{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
        "{{ bos_token }}{% endif %}{{ '<|' ~ m['role'] ~ '|>' }}{{ m['content'] | trim }}{{ eos_token }}"
        "{% set ns.first = false %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    )
    chat = ChatTemplate(template, "</s>", "<s>")
    assert chat.render(" Hi? ", system="Be brief.") == "<|system|>Be brief.</s><|user|>Hi?</s><|assistant|>"
    long_turn = "y" * 100000  # a long conversation is far inside the bounds
    assert chat.render(long_turn).endswith(long_turn + "</s><|assistant|>")


def test_the_tracer_is_restored_after_a_render():
    import sys

    previous = sys.gettrace()
    with pytest.raises(StemlmError):
        ChatTemplate(NESTED, None, None).render("hi")
    assert sys.gettrace() is previous


@pytest.fixture
def bomb_ckpt(tmp_path):
    folder = tmp_path / "ckpt"
    tok = default_tokenizer()
    save_pretrained(build_model(make_tiny_config("dense", vocab_size=tok.get_vocab_size())), folder, tokenizer=tok)

    def with_template(template: str):
        config = {"chat_template": template, "eos_token": "<|endoftext|>"}
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        return folder

    return with_template


@pytest.mark.parametrize(("template", "message"), [BOMBS[0], BOMBS[3]])
def test_generate_chat_exits_2_with_one_line(bomb_ckpt, tmp_path, capsys, template, message):
    folder = bomb_ckpt(template)
    refuse(["generate", folder, "Hi?", "--chat", "--max-new-tokens", "2"], message, capsys, tmp_path)


def test_the_playground_answers_400(bomb_ckpt, client_for):  # noqa: F811
    client, _ = client_for(bomb_ckpt(BOMBS[0][0]), chat=True)
    response = client.post("/api/tokenize", json={"prompt": "Hi?"})
    assert response.status_code == 400
    assert "chat template failed: repeating" in response.get_json()["error"]
