"""A local web playground for a checkpoint: generate, see STEM contributions, edit entities, save edits.

`stemlm serve CKPT` runs it (see `stemlm.cli.serve`); `Playground` holds the model and answers requests,
`create_app` is the Flask app around it (routes listed in `stemlm.serve.app`), and the page itself is plain
HTML/JS/CSS shipped in `stemlm/assets/web/`, so it works offline.
"""

from stemlm.serve.app import create_app
from stemlm.serve.editing import EditSpec
from stemlm.serve.playground import Playground

__all__ = ["EditSpec", "Playground", "create_app"]
