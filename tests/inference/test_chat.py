"""Tests of `stemlm.inference.chat` and `--chat` in generate: the rendered prompt equals transformers'
`apply_chat_template`, generation stops at the template's end-of-turn token, and a checkpoint without a
template is refused with a one-line error."""

from __future__ import annotations

import json

import pytest

from stemlm.checkpoint.folder import save_pretrained
from stemlm.cli.main import main
from stemlm.data.tokenizer import default_tokenizer
from stemlm.inference.chat import load_chat
from stemlm.model import build_model
from tests.conftest import make_tiny_config

# The shape of SmolLM2's template: a default system turn when none is given, then <|im_start|>role ... turns.
TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture
def chat_ckpt(tmp_path):
    tok = default_tokenizer()
    model = build_model(make_tiny_config("dense", vocab_size=tok.get_vocab_size()), seed=0)
    folder = tmp_path / "ckpt"
    save_pretrained(model, folder, tokenizer=tok)
    config = {"chat_template": TEMPLATE, "eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_render_matches_transformers(chat_ckpt):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(chat_ckpt / "tokenizer.json"))
    hf.chat_template = TEMPLATE
    chat = load_chat(chat_ckpt)
    for system in (None, "Be brief."):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "Hi?"}]
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert chat.render("Hi?", system=system) == expected
    assert chat.eos_token == "<|endoftext|>"


def test_generate_chat_wraps_the_prompt(chat_ckpt, capsys):
    assert main(["generate", str(chat_ckpt), "Hi?", "--chat", "--greedy", "--max-new-tokens", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt"] == load_chat(chat_ckpt).render("Hi?")
    assert out["prompt_ids"] == default_tokenizer().encode(out["prompt"]).ids


def test_checkpoint_without_template_is_refused(chat_ckpt, capsys):
    (chat_ckpt / "tokenizer_config.json").unlink()
    assert load_chat(chat_ckpt) is None
    assert main(["generate", str(chat_ckpt), "Hi?", "--chat"]) == 2
    assert "has no chat template" in capsys.readouterr().err


def test_playground_chat_encodes_user_turns(chat_ckpt):
    from stemlm.serve import Playground

    pg = Playground.load(chat_ckpt, chat=True)
    assert pg.encode("Hi?") == default_tokenizer().encode(load_chat(chat_ckpt).render("Hi?")).ids
    assert pg.eos_id == default_tokenizer().token_to_id("<|endoftext|>")
    assert Playground.load(chat_ckpt).encode("Hi?") == default_tokenizer().encode("Hi?").ids
