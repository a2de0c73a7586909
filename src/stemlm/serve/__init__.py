"""Serving a checkpoint: one server for the local web playground and the OpenAI-compatible API.

`stemlm serve CKPT` (alias `stemlm server`; see `stemlm.cli.serve`) loads the checkpoint once as a `ServedModel`
(its batch engine decodes every request), `Playground` answers the page's requests over it, and `create_app` is
the one FastAPI app: the page (plain HTML/JS/CSS shipped in `stemlm/assets/web/`, so it works offline) and its
/api routes (`stemlm.serve.app`) beside /v1 (`stemlm.serve.openai_app`, docs/serving.md); `stemlm.serve.server`
runs it under uvicorn. Names load lazily:

    from stemlm.serve import Playground, create_app
"""

from stemlm._lazy import lazy_exports

_EXPORTS = {
    "EditSpec": "stemlm.serve.editing",
    "Playground": "stemlm.serve.playground",
    "ServedModel": "stemlm.serve.served_model",
    "Server": "stemlm.serve.server",
    "create_app": "stemlm.serve.app",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
