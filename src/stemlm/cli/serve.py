"""`stemlm serve CKPT`: a local web playground to generate, see STEM contributions and edit entities.

    stemlm serve runs/tiny                                   # http://127.0.0.1:7860/
    stemlm serve runs/tiny --tables host --cache-fraction 0.2 --save-dir edited/
    stemlm serve ckpt/tiny-int8 --tables mmap --device cuda --dtype bf16   # int8 rows mapped, bf16 autocast

The page works offline (no CDN). It listens on loopback unless --host says otherwise; it has no login, so
only expose it on a network you trust. Edited checkpoints are saved only under --save-dir, each in a new
folder, never over the served checkpoint. Needs Flask: pip install 'flask>=3.0'.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys

from stemlm.cli.common import add_inference_flags
from stemlm.errors import StemlmError


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def port_number(text: str) -> int:
    """argparse type of --port: an integer in 0..65535 (0: a free port)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is outside 0..65535")
    return port


def listen(host: str, port: int) -> socket.socket:
    """A listening socket, bound here so a taken port is a one-line error (werkzeug would exit the process)."""
    from werkzeug.serving import get_sockaddr, select_address_family

    family = select_address_family(host, port)
    try:
        return socket.create_server(get_sockaddr(host, port, family), family=family)
    except OSError as exc:
        raise StemlmError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; try another --port") from None


def run(args) -> int:
    try:
        from werkzeug.serving import make_server

        from stemlm.serve import Playground, create_app
        from stemlm.serve.app import trusted_hosts
    except ImportError as exc:
        raise StemlmError(f"stemlm serve needs Flask ({exc.name} is missing): pip install 'flask>=3.0'") from None

    from stemlm.inference.load import InferenceOptions

    pg = Playground.load(args.ckpt, InferenceOptions.from_args(args), save_dir=args.save_dir, chat=args.chat)
    try:
        with listen(args.host, args.port) as sock:  # the server keeps its own duplicate of the descriptor
            app = create_app(pg, trusted_hosts(args.host, args.allow_host))
            server = make_server(args.host, args.port, app, threaded=True, fd=sock.fileno())
        if not _is_loopback(args.host):
            warning = f"listening on {args.host}: reachable from other machines, and the page has no login"
            print(f"stemlm serve: warning: {warning}", file=sys.stderr)
        shown = f"[{args.host}]" if ":" in args.host else args.host  # an IPv6 address in a URL needs brackets
        print(f"stemlm serve: {pg.checkpoint} at http://{shown}:{server.port}/ (Ctrl-C stops)", file=sys.stderr)
        try:
            server.serve_forever()  # returns on Ctrl-C (werkzeug's server catches the KeyboardInterrupt)
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
        print("stemlm serve: stopped", file=sys.stderr)
    finally:
        pg.close()
    # werkzeug's request threads are daemons; tearing the interpreter down under one that still holds torch's
    # thread pool intermittently aborts ("terminate called without an active exception", exit -6), so a server
    # that was stopped leaves at once, its own resources already released above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="local web playground: generate, see STEM contributions, edit entities",
        description="Serve a web page to generate from a checkpoint, see each position's STEM contribution per "
        "layer and nearest tokens, and try entity edits before/after; runs offline on loopback by default.",
    )
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint folder, or run folder (uses its newest checkpoint)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, this machine only)")
    p.add_argument(
        "--port", type=port_number, default=7860, help="port to listen on (default 7860; 0 picks a free one)"
    )
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="also answer requests whose Host header is NAME (repeatable; default: loopback names and --host only, "
        "which guards against DNS rebinding)",
    )
    add_inference_flags(p)
    p.add_argument(
        "--save-dir",
        metavar="DIR",
        help="folder where the page may save globally edited checkpoints, one new subfolder each (off if unset)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap every prompt as a user turn with the checkpoint's chat template (e.g. an imported instruct GGUF)",
    )
    p.set_defaults(func=run)
