"""Reading the JSON body of a request: its bytes up to a limit, typed fields with bounds, and errors a page can show.

`read_body` reads a request's body up to MAX_BODY (`BodyTooLarge`, a 413, past it). Every field error is a
`StemlmError` naming the field and what it accepts; the app turns it into a 400 JSON response `{"error": message}`
that the page shows as is. `sampling(body)` reads the generation controls shared by the generate and edit
routes. `parse_json(raw)` decodes a request body for every route (the playground's and the OpenAI-compatible
API's): invalid UTF-8 or JSON, nesting too deep for the parser and integers too long to convert are one-line
errors, not 500s. Numbers are strict: NaN, Infinity and 1e400 (which Python's parser reads as inf) are refused by
the field that holds them, a whole-number field takes only an integral finite number, and `true` or `"5"` is never
a number; a text holding a lone surrogate is refused as well.

    body = Body(parse_json(await read_body(request)))
    prompt = body.text("prompt")
    k = body.integer("top_k", default=10, low=1, high=50)
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from stemlm.errors import StemlmError

MAX_BODY = 1 << 20  # bytes of a request body, for every route of the server
MAX_TEXT = 20_000  # characters of a prompt or entity; longer texts would not fit the context anyway
MAX_NEW_TOKENS = 256
SHOWN = 40  # characters of a refused value quoted in an error: a 4000-digit number stays one short line


def parse_json(raw: bytes) -> Any:
    """The JSON value of a request body, or a one-line StemlmError saying why it is not one."""
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise StemlmError(f"the request body is not UTF-8 (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}"
        raise StemlmError(f"the request body is not valid JSON ({exc.msg} at {where}); send one JSON object") from None
    except RecursionError:  # nested thousands deep: the parser's recursion limit, not a server fault
        raise StemlmError("the request body is nested too deeply") from None
    except ValueError:  # Python refuses to convert integers of more than 4300 digits
        raise StemlmError("the request body holds an integer too long to read") from None


class BodyTooLarge(StemlmError):
    """A request body over MAX_BODY bytes (HTTP 413)."""


async def read_body(request) -> bytes:
    """A Starlette request's body, or `BodyTooLarge` once past MAX_BODY: an announced length is refused unread, a
    chunked body (no length) as soon as it grows past the limit."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise BodyTooLarge(f"the request body is {int(declared)} bytes; this server takes at most {MAX_BODY}")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY:
            raise BodyTooLarge(f"the request body is over {MAX_BODY} bytes; this server takes at most that")
    return bytes(raw)


def shown(value: Any) -> str:
    """`repr(value)` cut to SHOWN characters, for error messages."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**SHOWN else f"a {len(str(value))}-digit number"
    return text if len(text) <= SHOWN else text[: SHOWN - 3] + "..."


def valid_text(value: str, name: str) -> str:
    """`value` unless it holds a lone surrogate (JSON allows "\\ud800"; no tokenizer can encode it)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise StemlmError(f"{name} holds a lone surrogate at character {exc.start}; send valid Unicode text") from None
    return value


def whole_number(value: Any) -> bool:
    """Whether a JSON value is an integral, finite number (5 or 5.0; not true, "5", 5.5, NaN or inf)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value) and value.is_integer())


class Body:
    """The fields of one request's JSON object."""

    def __init__(self, data: Any) -> None:
        if not isinstance(data, dict):
            raise StemlmError("the request body must be a JSON object (Content-Type: application/json)")
        self.data = data

    def _get(self, name: str, default: Any) -> Any:
        value = self.data.get(name)
        return default if value is None else value

    def text(self, name: str, default: str | None = None, *, allow_empty: bool = False) -> str:
        value = self._get(name, default)
        if value is None:
            raise StemlmError(f"missing field {name!r}")
        if not isinstance(value, str):
            raise StemlmError(f"{name} must be a string")
        if len(value) > MAX_TEXT:
            raise StemlmError(f"{name} is {len(value)} characters; the playground takes at most {MAX_TEXT}")
        if not allow_empty and not value.strip():
            raise StemlmError(f"{name} is empty: type some text first")
        return valid_text(value, name)

    def optional_text(self, name: str) -> str | None:
        value = self._get(name, None)
        return None if value is None or (isinstance(value, str) and not value.strip()) else self.text(name)

    def integer(self, name: str, default: int, low: int, high: int) -> int:
        value = self._get(name, default)
        if not whole_number(value):
            raise StemlmError(f"{name} must be a whole number between {low} and {high}, got {shown(value)}")
        if not low <= value <= high:
            raise StemlmError(f"{name} must be between {low} and {high}, got {shown(int(value))}")
        return int(value)

    def number(self, name: str, default: float, low: float, high: float) -> float:
        value = self._get(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise StemlmError(f"{name} must be a number between {low} and {high}, got {shown(value)}")
        if not low <= value <= high:
            raise StemlmError(f"{name} must be between {low} and {high}, got {shown(value)}")
        return float(value)

    def boolean(self, name: str, default: bool) -> bool:
        value = self._get(name, default)
        if not isinstance(value, bool):
            raise StemlmError(f"{name} must be true or false, got {shown(value)}")
        return value

    def choice(self, name: str, default: str, choices: Sequence[str]) -> str:
        value = self._get(name, default)
        if value not in choices:
            raise StemlmError(f"{name} must be one of {', '.join(choices)}, got {shown(value)}")
        return value

    def int_list(self, name: str) -> tuple[int, ...] | None:
        """A list of whole numbers, or None when the field is absent (meaning "all")."""
        value = self._get(name, None)
        if value is None:
            return None
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise StemlmError(f"{name} must be a list of whole numbers, got {shown(value)}")
        return tuple(value)


def sampling(body: Body) -> dict:
    """The generation controls: max_new_tokens plus the keyword arguments of
    `stemlm.inference.generate.stream_tokens`."""
    return {
        "max_new_tokens": body.integer("max_new_tokens", 32, 1, MAX_NEW_TOKENS),
        "greedy": body.boolean("greedy", False),
        "temperature": body.number("temperature", 1.0, 0.0, 10.0),
        "top_k": body.integer("top_k", 0, 0, 1_000_000),
        "top_p": body.number("top_p", 1.0, 1e-6, 1.0),
        "seed": body.integer("seed", 0, 0, 2**63 - 1),
    }
