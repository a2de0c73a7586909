"""Strict parsing of OpenAI completion and chat requests into prompts, sampling settings and an edit.

Every field is checked for type and range (numbers strictly, texts for lone surrogates: `stemlm.serve.params`)
and an unknown field is refused, so a client never silently gets
other behaviour than it asked for; each error is one line (`StemlmError`) that the app returns as 400 in
OpenAI's error shape. Accepted fields (OpenAI's names and defaults):

    both:        model, max_tokens (16 / chat: up to the context), temperature (1), top_p (1), seed (0),
                 stop (a string or up to 4), stream, stream_options.include_usage, n (1..16 choices per prompt),
                 user, presence_penalty / frequency_penalty (0 only), and the extension
                 edit: {source, target, strategy, rows, layers} (a positional edit, this request only; the old
                 name stem_edit is accepted too)
    completions: prompt (a string, a list of token ids, or a list of either: several prompts), logprobs (0..5),
                 echo (the prompt before the completion; with logprobs, the prompt tokens' too, the first null;
                 max_tokens may then be 0: scoring a prompt; not with stream)
    chat:        messages [{role: system|user|assistant, content: string}], max_completion_tokens,
                 logprobs (bool), top_logprobs (0..20)

A request asks for at most MAX_CHOICES completions in all (prompts x n).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from stemlm.choices import edit_row_kind
from stemlm.errors import StemlmError
from stemlm.inference.sampling import MAX_LOGPROBS, SamplingParams
from stemlm.serve.editing import EditSpec
from stemlm.serve.params import shown, valid_text

MAX_TEXT = 100_000  # characters of one prompt or message
MAX_STOPS = 4  # OpenAI's limit
MAX_N = 16  # completions per prompt
MAX_CHOICES = 64  # completions per request (prompts x n): the engine's default waiting queue
COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n", "user"}
COMMON |= {"presence_penalty", "frequency_penalty", "edit", "stem_edit"}
COMPLETION = COMMON | {"prompt", "logprobs", "echo"}
CHAT = COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
ROLES = ("system", "user", "assistant")
EDIT_FIELDS = {"source", "target", "strategy", "rows", "layers"}


@dataclass
class ParsedRequest:
    prompts: list[str | list[int]]  # each text (completions, or the rendered chat) or token ids
    messages: list[dict[str, str]] | None  # chat only, still to be rendered with the checkpoint's template
    params: SamplingParams
    stream: bool
    include_usage: bool
    edit: EditSpec | None
    n: int = 1  # completions per prompt; choice index = prompt index * n + j
    echo: bool = False  # completions: the prompt's text (and with logprobs its tokens') before each completion

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n


def _check_fields(body: Any, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise StemlmError("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise StemlmError(f"unknown field {unknown[0]!r}; this server accepts {', '.join(sorted(allowed))}")
    return body


def _integer(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise StemlmError(f"{name} must be a whole number between {low} and {high}, got {shown(value)}")
    if not low <= value <= high:
        raise StemlmError(f"{name} must be between {low} and {high}, got {shown(value)}")
    return value


def _number(body: dict, name: str, default: float, low: float, high: float, *, open_low: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise StemlmError(f"{name} must be a number, got {shown(value)}")
    if value > high or value < low or (open_low and value == low):
        side = "(" if open_low else "["
        raise StemlmError(f"{name} must be in {side}{low}, {high}], got {value}")
    return float(value)


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise StemlmError(f"{name} must be true or false, got {shown(value)}")
    return value


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise StemlmError(f"{name} must be a string")
    if len(value) > MAX_TEXT:
        raise StemlmError(f"{name} is {len(value)} characters; this server takes at most {MAX_TEXT}")
    return valid_text(value, name)


def _stops(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not stops or len(stops) > MAX_STOPS:
        raise StemlmError(f"stop must be a string or a list of 1 to {MAX_STOPS} strings")
    if any(not isinstance(s, str) or not s for s in stops):
        raise StemlmError("stop must hold non-empty strings")
    return tuple(valid_text(s, "stop") for s in stops)


def _edit(body: dict) -> EditSpec | None:
    if "edit" in body and "stem_edit" in body:
        raise StemlmError("give the edit once: edit (stem_edit is its old name)")
    key = "edit" if "edit" in body else "stem_edit"
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise StemlmError(f'{key} must be an object like {{"source": "Spain", "target": "Germany"}}')
    unknown = sorted(set(value) - EDIT_FIELDS)
    if unknown:
        raise StemlmError(f"unknown {key} field {unknown[0]!r}; accepted: {', '.join(sorted(EDIT_FIELDS))}")
    for name in ("source", "target"):
        if not isinstance(value.get(name), str) or not value[name].strip():
            raise StemlmError(f"{key}.{name} must be a non-empty string")
        _text(value[name], f"{key}.{name}")
    layers = value.get("layers")
    if layers is not None and (
        not isinstance(layers, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in layers)
    ):
        raise StemlmError(f"{key}.layers must be a list of layer numbers")
    for name in ("strategy", "rows"):
        if name in value and not isinstance(value[name], str):
            raise StemlmError(f"{key}.{name} must be a string")
    return EditSpec(
        target=value["target"],
        source=value["source"],
        strategy=value.get("strategy", "auto"),
        rows=edit_row_kind(value.get("rows", "tables")),
        layers=None if layers is None else tuple(layers),
    )


def _common(
    body: dict, max_tokens_name: str, default_max: int, context: int, stop_ids, logprobs, *, min_tokens: int = 1
) -> dict:
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise StemlmError(f"{name} is not supported (only 0)")
    if body.get("model") is not None and not isinstance(body["model"], str):  # null: the served one (vLLM)
        raise StemlmError("model must be a string")
    if "user" in body:
        _text(body["user"], "user")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise StemlmError('stream_options must be an object like {"include_usage": true}')
    params = SamplingParams(
        max_tokens=_integer(body, max_tokens_name, default_max, min_tokens, context),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
        seed=_integer(body, "seed", 0, 0, 2**63 - 1),
        stop=_stops(body),
        stop_ids=tuple(stop_ids),
        logprobs=logprobs,
    )
    return dict(
        params=params,
        stream=_boolean(body, "stream", False),
        include_usage=_boolean(options or {}, "include_usage", False),
        edit=_edit(body),
        n=_integer(body, "n", 1, 1, MAX_N),
    )


def _prompts(value: Any) -> list[str | list[int]]:
    """The prompts of a completions body: one string or list of token ids, or a non-empty list of either."""
    ids = lambda v: isinstance(v, list) and v and all(isinstance(i, int) and not isinstance(i, bool) for i in v)
    if isinstance(value, str):
        return [_text(value, "prompt")]
    if ids(value):
        return [list(value)]
    if value is None:
        raise StemlmError("missing field 'prompt' (a string, a list of token ids, or a list of either)")
    if not isinstance(value, list):
        raise StemlmError(f"prompt must be a string, a list of token ids, or a list of either, got {shown(value)}")
    if not value:
        raise StemlmError("prompt is an empty list; give at least one prompt")
    if len(value) > MAX_CHOICES:
        raise StemlmError(f"prompt holds {len(value)} prompts; this server takes at most {MAX_CHOICES} a request")
    prompts = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            prompts.append(_text(item, f"prompt[{i}]"))
        elif ids(item):
            prompts.append(list(item))
        else:
            raise StemlmError(f"prompt[{i}] must be a string or a non-empty list of token ids")
    return prompts


def parse_completion(body: Any, context: int, stop_ids=()) -> ParsedRequest:
    """A /v1/completions body; `context`: the model's positions (bounds max_tokens); `stop_ids`: eos."""
    body = _check_fields(body, COMPLETION)
    echo = _boolean(body, "echo", False)
    prompts = _prompts(body.get("prompt"))
    logprobs = _integer(body, "logprobs", None, 0, 5)
    parsed = ParsedRequest(
        prompts, None, **_common(body, "max_tokens", 16, context, stop_ids, logprobs, min_tokens=0 if echo else 1)
    )
    if echo and parsed.stream:
        raise StemlmError("echo is not supported with stream; send stream: false")
    if parsed.choices > MAX_CHOICES:
        raise StemlmError(
            f"this request asks for {parsed.choices} completions ({len(prompts)} prompts x n={parsed.n}); "
            f"this server takes at most {MAX_CHOICES}"
        )
    parsed.echo = echo
    if echo and logprobs is not None:  # the prompt's tokens scored by the prefill that generation runs anyway
        parsed.params = replace(parsed.params, prompt_logprobs=logprobs)
    return parsed


def parse_chat(body: Any, context: int, stop_ids=()) -> ParsedRequest:
    """A /v1/chat/completions body (see `parse_completion`)."""
    body = _check_fields(body, CHAT)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise StemlmError("messages must be a non-empty list of {role, content} objects")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) - {"role", "content", "name"} or "content" not in message:
            raise StemlmError(f"messages[{i}] must be an object with role and content")
        if message.get("role") not in ROLES:
            raise StemlmError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {shown(message.get('role'))}")
        clean.append({"role": message["role"], "content": _text(message["content"], f"messages[{i}].content")})
    logprobs = None
    if _boolean(body, "logprobs", False):
        logprobs = _integer(body, "top_logprobs", 0, 0, MAX_LOGPROBS)
    elif body.get("top_logprobs") is not None:
        raise StemlmError("top_logprobs needs logprobs: true")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return ParsedRequest([""], clean, **_common(body, name, context, context, stop_ids, logprobs))
