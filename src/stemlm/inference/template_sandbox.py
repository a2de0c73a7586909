"""Rendering an untrusted Jinja2 template with bounds on time, work and size: a chat template comes from a file
someone else wrote (a GGUF's `tokenizer.chat_template`, a downloaded tokenizer_config.json).

    from stemlm.inference.template_sandbox import render_bounded
    text = render_bounded(source, messages=[...], add_generation_prompt=True)   # TemplateLimitError past a bound

Jinja2's `ImmutableSandboxedEnvironment` already blocks attribute escapes, mutation of the inputs and ranges over
100000 items, but not work or memory: `{{ 'x' * 10**10 }}` allocates 10 GB in one C call, and three nested
`range(100000)` loops run for days. `BoundedEnvironment` adds what a render may not exceed:

- every value the template builds (`*`, `+`, `**`, `%`, `~`, a call, a filter) is at most `MAX_CHARS` long, and
  the calls that grow a string from a small argument (`center(10**9)`, `replace('', ...)`) are checked from their
  arguments before they run, so no single operation allocates more than that;
- integers stay under `MAX_INT_BITS` bits (`10**10**10` would otherwise compute forever);
- the rendered text is at most `MAX_CHARS` long, counted while it is produced;
- the template's own code runs at most `MAX_STEPS` lines (loop iterations included) and `MAX_SECONDS` of wall
  clock, counted by a line tracer on the template's frames alone (`sys.settrace` is per thread, so a server
  rendering in a request thread bounds that request only).

Real templates (SmolLM2's, Llama 3's, Qwen's) render a conversation in a few hundred steps and kilobytes, far
inside every bound.
"""

from __future__ import annotations

import functools
import re
import sys
import time
from typing import Any

from jinja2.compiler import CodeGenerator
from jinja2.environment import Environment
from jinja2.exceptions import TemplateError
from jinja2.nodes import EvalContext
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_CHARS = 1 << 22  # 4M characters: any one value and the whole output
MAX_INT_BITS = 1 << 12
MAX_STEPS = 1_000_000
MAX_SECONDS = 5.0
MAX_TEMPLATE_CHARS = 1 << 20  # the template's source itself (real ones are a few KB)
_TEMPLATE_FILE = "<template>"  # the filename Jinja2 compiles `from_string` templates under


class TemplateLimitError(TemplateError):
    """A render went past one of the bounds of this module."""


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def checked(value: Any) -> Any:
    """`value` unless it is larger than a render may build."""
    if _size(value) > MAX_CHARS:
        raise TemplateLimitError(f"the template built a value of {_size(value):,} items (limit {MAX_CHARS:,})")
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
        raise TemplateLimitError(f"the template built an integer of {value.bit_length():,} bits")
    return value


def _joined_length(items: Any, separator: str) -> int:
    if not isinstance(items, (list, tuple)):
        return 0  # a generator or a mapping: its result is checked once built
    return sum(len(x) if isinstance(x, str) else 32 for x in items) + len(separator) * len(items)


def _predicted(name: str, target: Any, args: tuple, kwargs: dict) -> None:
    """Refuse, before it runs, an operation whose result would exceed MAX_CHARS: a size argument over it
    (`center(10**9)`, a width in a format string) or a str result predicted from the operands' lengths."""
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, int) and not isinstance(arg, bool) and arg > MAX_CHARS:
            raise TemplateLimitError(f"{name}() was given {arg:,} (values are limited to {MAX_CHARS:,} items)")
    if name in ("format", "format_map") and isinstance(target, str):
        widths = [int(n) for n in re.findall(r"\d+", target) if len(n) < 12]
        if any(len(n) >= 12 for n in re.findall(r"\d+", target)) or any(w > MAX_CHARS for w in widths):
            raise TemplateLimitError(f"a format string asks for a width over {MAX_CHARS:,}")
    if name == "join":
        items, separator = (args[0], target) if isinstance(target, str) else (target, args[0] if args else "")
        estimate = _joined_length(items, separator if isinstance(separator, str) else "")
    elif not isinstance(target, str):
        return
    elif name == "replace" and len(args) >= 2 and isinstance(args[1], str):
        estimate = len(target) + (len(target) + 1) * len(args[1])
    elif name in ("expandtabs", "indent"):
        estimate = len(target) * (1 + next((a for a in (*args, *kwargs.values()) if isinstance(a, int)), 8))
    else:
        return
    if estimate > MAX_CHARS:
        raise TemplateLimitError(f"{name}() could build {estimate:,} characters (limit {MAX_CHARS:,})")


def _concat(pieces) -> str:
    """The join of a rendered buffer (a `{% set %}` block, a macro's body), its length checked before joining."""
    pieces = list(pieces)
    if sum(map(len, pieces)) > MAX_CHARS:
        raise TemplateLimitError(f"the template built a text over {MAX_CHARS:,} characters")
    return "".join(pieces)


def _power(base: Any, exponent: Any) -> Any:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
        if max(base.bit_length(), 1) * exponent > MAX_INT_BITS:
            raise TemplateLimitError(f"{base} ** {exponent} is too large an integer for a template")
    return base**exponent


def _repeat(left: Any, right: Any) -> Any:
    for seq, count in ((left, right), (right, left)):
        if _size(seq) and isinstance(count, int) and _size(seq) * count > MAX_CHARS:
            raise TemplateLimitError(f"repeating {_size(seq):,} items {count:,} times exceeds {MAX_CHARS:,}")
    return left * right


class _BoundedGenerator(CodeGenerator):
    """Jinja2's code generator, with every `a ~ b` concatenation's result checked."""

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.checked(")
        super().visit_Concat(node, frame)
        self.write(")")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """Jinja2's immutable sandbox with the size bounds of the module docstring (the time bounds are
    `render_bounded`'s)."""

    code_generator_class = _BoundedGenerator
    intercepted_binops = frozenset(["*", "**", "+", "%", "//"])
    concat = staticmethod(_concat)  # the compiled template's `concat`, used for every buffer it joins

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.checked = checked
        self.binop_table = {**self.binop_table, "*": _repeat, "**": _power}
        self.filters = {name: self._bounded(name, f) for name, f in self.filters.items()}

    def _bounded(self, name: str, func):
        @functools.wraps(func)  # keeps Jinja2's pass_context / pass_environment marks
        def filter_(*args, **kwargs):
            values = [a for a in args if not isinstance(a, (Context, EvalContext, Environment))]  # pass_* args
            _predicted(name, values[0] if values else None, tuple(values[1:]), kwargs)
            return checked(func(*args, **kwargs))

        return filter_

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "%" and isinstance(left, str):  # printf-style: widths in the string or as `*` arguments
            _predicted("format", left, right if isinstance(right, tuple) else (right,), {})
        return checked(super().call_binop(context, operator, left, right))

    def wrap_str_format(self, value: Any):
        """Jinja2's sandboxed `str.format` / `format_map`, with the format string's widths checked first."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None

        @functools.wraps(wrapped)
        def format_(*args, **kwargs):
            _predicted("format", value.__self__, args, kwargs)
            return checked(wrapped(*args, **kwargs))

        return format_

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja2's signature)
        _predicted(getattr(__obj, "__name__", "call"), getattr(__obj, "__self__", None), args, kwargs)
        return checked(super().call(__context, __obj, *args, **kwargs))


class _Budget:
    """A `sys.settrace` tracer counting the lines the template's own code runs, against steps and a deadline."""

    def __init__(self) -> None:
        self.steps = 0
        self.deadline = time.monotonic() + MAX_SECONDS

    def __call__(self, frame, event, arg):
        return self._line if frame.f_code.co_filename == _TEMPLATE_FILE else None

    def _line(self, frame, event, arg):
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise TemplateLimitError(f"the template ran more than {MAX_STEPS:,} steps (nested loops?)")
        if self.steps % 1024 == 0 and time.monotonic() > self.deadline:
            raise TemplateLimitError(f"the template ran for more than {MAX_SECONDS:g} s")
        return self._line


def render_bounded(source: str, **variables: Any) -> str:
    """`source` rendered with `variables` in a `BoundedEnvironment` (transformers' trim/lstrip settings and
    `raise_exception`), within every bound; a template error or a bound raises `TemplateError`."""
    if len(source) > MAX_TEMPLATE_CHARS:
        raise TemplateLimitError(f"the template is {len(source):,} characters long (limit {MAX_TEMPLATE_CHARS:,})")

    def raise_exception(message):
        raise TemplateError(message)

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    previous = sys.gettrace()
    sys.settrace(_Budget())
    try:
        pieces, length = [], 0
        for piece in env.from_string(source).generate(**variables):
            length += len(piece)
            if length > MAX_CHARS:
                raise TemplateLimitError(f"the rendered prompt exceeds {MAX_CHARS:,} characters")
            pieces.append(piece)
        return "".join(pieces)
    finally:
        sys.settrace(previous)
