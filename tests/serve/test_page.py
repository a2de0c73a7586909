"""The playground page's static promises, read from its files (no browser): the sampling controls start at
`stemlm generate`'s defaults, and every edit strategy and pad row the server lists has plain words in app.js.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from importlib import resources

import pytest

from stemlm.cli.generate import DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P
from stemlm.edit import PAD_ROWS, STRATEGIES

WEB = resources.files("stemlm") / "assets" / "web"


class Inputs(HTMLParser):
    """id -> attributes of every <input>, and the ids of the top-k table boxes (class "top")."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: dict[str, dict] = {}
        self.top_boxes: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "input" and "id" in attrs:
            self.inputs[attrs["id"]] = attrs
        if "top" in (attrs.get("class") or "").split():
            self.top_boxes.append(attrs.get("id"))


@pytest.fixture(scope="module")
def page() -> Inputs:
    parser = Inputs()
    parser.feed((WEB / "index.html").read_text(encoding="utf-8"))
    return parser


def test_sampling_starts_at_the_cli_defaults(page):
    assert float(page.inputs["temperature"]["value"]) == DEFAULT_TEMPERATURE
    assert int(page.inputs["top-k"]["value"]) == DEFAULT_TOP_K
    assert float(page.inputs["top-p"]["value"]) == DEFAULT_TOP_P


def test_the_defaults_that_differ_are_labelled():
    html = (WEB / "index.html").read_text(encoding="utf-8")
    note = re.search(r'<p id="sampling-note"[^>]*>(.*?)</p>', html, re.S).group(1)
    assert "greedy" in note.lower() and "16 here, 64 in" in note  # the page's greedy and new-tokens defaults


def test_one_top_k_table(page):
    assert page.top_boxes == ["edit-top"]


@pytest.mark.parametrize("table, names", [("STRATEGY_WORDS", STRATEGIES), ("PAD_WORDS", PAD_ROWS)])
def test_every_choice_has_words(table, names):
    script = (WEB / "app.js").read_text(encoding="utf-8")
    body = re.search(rf"const {table} = \{{(.*?)\n\}};", script, re.S).group(1)
    assert re.findall(r"^  (\w+): \[", body, re.M) == list(names)
