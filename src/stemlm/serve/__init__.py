"""Serving a checkpoint: the local web playground and the OpenAI-compatible API.

`stemlm serve CKPT` runs the playground (see `stemlm.cli.serve`); `Playground` holds the model and answers
requests, `create_app` is the Flask app around it (routes listed in `stemlm.serve.app`), and the page itself
is plain HTML/JS/CSS shipped in `stemlm/assets/web/`, so it works offline. `stemlm server CKPT` runs the
OpenAI-compatible API over the continuous-batching engine (`stemlm.serve.openai_app`, docs/serving.md).
Names load lazily, so the API never imports Flask and the playground never imports FastAPI.
"""

from stemlm._lazy import lazy_exports

_EXPORTS = {
    "EditSpec": "stemlm.serve.editing",
    "Playground": "stemlm.serve.playground",
    "create_app": "stemlm.serve.app",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
