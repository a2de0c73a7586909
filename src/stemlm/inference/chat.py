"""Chat templates: the `chat_template` of a checkpoint's tokenizer_config.json, rendered as transformers does.

    from stemlm.inference.chat import load_chat
    chat = load_chat("ckpt/smollm2")          # None when the checkpoint has no template
    prompt = chat.render("What is the capital of France?")   # system preamble + user turn + assistant header
    eos = tokenizer.token_to_id(chat.eos_token)               # stop at the end of the assistant's turn

`stemlm convert --from-gguf` writes the GGUF's template there; `stemlm generate --chat` and `stemlm serve --chat`
use it. Rendering is Jinja2 in a sandbox with transformers' settings (trim_blocks, lstrip_blocks,
`raise_exception`), so a template gives the same text here as `AutoTokenizer.apply_chat_template`. The template is
untrusted (it came with the model file): `stemlm.inference.template_sandbox` bounds the render's time, steps and
sizes, so a resource bomb is one error line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stemlm.checkpoint.folder import read_json_object
from stemlm.errors import StemlmError

TOKENIZER_CONFIG = "tokenizer_config.json"


@dataclass(frozen=True)
class ChatTemplate:
    template: str
    eos_token: str | None
    bos_token: str | None

    def render(self, user_text: str, system: str | None = None) -> str:
        """The prompt for one user turn, ending with the assistant's header (add_generation_prompt=True)."""
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user_text}
        ]
        return self.render_messages(messages)

    def render_messages(self, messages: list[dict[str, str]]) -> str:
        """The prompt for a conversation (`{"role", "content"}` dicts, as OpenAI's chat API sends them), ending
        with the assistant's header (add_generation_prompt=True)."""
        from jinja2.exceptions import TemplateError

        from stemlm.inference.template_sandbox import render_bounded

        try:
            return render_bounded(
                self.template,
                messages=messages,
                add_generation_prompt=True,
                eos_token=self.eos_token or "",
                bos_token=self.bos_token or "",
            )
        except TemplateError as exc:
            raise StemlmError(f"the checkpoint's chat template failed: {exc}") from None
        except (RecursionError, MemoryError) as exc:  # a self-calling macro; an allocation the bounds did not see
            raise StemlmError(f"the checkpoint's chat template failed: {type(exc).__name__}") from None
        except (TypeError, ValueError, ArithmeticError, LookupError, AttributeError) as exc:  # `{{ 1 + 'a' }}` etc.
            raise StemlmError(f"the checkpoint's chat template failed: {type(exc).__name__}: {exc}") from None


def _token(value) -> str | None:
    # tokenizer_config.json stores a special token as a string or as {"content": ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat(folder: str | Path) -> ChatTemplate | None:
    """The chat template of the checkpoint folder, or None when it has none."""
    path = Path(folder) / TOKENIZER_CONFIG
    if not path.is_file():
        return None
    data = read_json_object(path)
    template = data.get("chat_template")
    if not isinstance(template, str) or not template:
        return None
    return ChatTemplate(template, _token(data.get("eos_token")), _token(data.get("bos_token")))


def require_chat(folder: str | Path) -> ChatTemplate:
    chat = load_chat(folder)
    if chat is None:
        raise StemlmError(
            f"checkpoint {folder} has no chat template (tokenizer_config.json chat_template); drop --chat"
        )
    return chat
