"""`stemlm serve CKPT` (alias `stemlm server`): one server for the web playground and the OpenAI-compatible API.

    stemlm serve runs/tiny                                   # page at http://127.0.0.1:7860/, API at .../v1
    stemlm serve runs/tiny --tables host --cache-fraction 0.2 --save-dir edited/ --slots 16 --max-queue 64
    stemlm serve ckpt/tiny-int8 --tables mmap --device cuda --dtype bf16   # int8 rows mapped, bf16 autocast
    curl -s 127.0.0.1:7860/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "tiny", "prompt": "The capital of Spain is", "max_tokens": 8, "temperature": 0,
             "edit": {"source": "Spain", "target": "Germany"}}'

One process loads the checkpoint once and decodes every generation, the page's and the API clients', in one
continuous batch (`stemlm.serve.served_model`); the page (generate, see STEM contributions, edit entities) works
offline (no CDN), and the API serves /v1/models, /v1/completions and /v1/chat/completions (streamed or not) and
/metrics. It listens on loopback unless --host says otherwise and has no login, so only expose it on a network you
trust. Edited checkpoints are saved only under --save-dir, each in a new folder, never over the served checkpoint.
Ctrl-C (or SIGTERM) stops it gracefully: in-flight requests finish for up to --graceful-timeout seconds. See
docs/serving.md.
"""

from __future__ import annotations

import argparse
import ipaddress
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
        raise argparse.ArgumentTypeError(f"--port {port} is outside 0..65535")
    return port


def run(args) -> int:
    from stemlm.inference.load import InferenceOptions
    from stemlm.placement.registry import INFERENCE, choose
    from stemlm.serve import Playground
    from stemlm.serve.server import Server

    limits = (("--slots", args.slots, 1), ("--max-queue", args.max_queue, 0), ("--step-tokens", args.step_tokens, 1))
    for flag, value, low in limits:
        if value < low:
            raise StemlmError(f"{flag} must be >= {low}, got {value}")
    if not args.request_timeout > 0 or not args.graceful_timeout >= 0:
        raise StemlmError("--request-timeout must be > 0 and --graceful-timeout >= 0 seconds")
    if args.compile is None:
        args.compile = choose(args.tables, INFERENCE).compiles
    pg = Playground.load(
        args.ckpt,
        InferenceOptions.from_args(args),
        save_dir=args.save_dir,
        chat=args.chat,
        name=args.served_model_name,
        slots=args.slots,
        step_tokens=args.step_tokens,
        max_queue=args.max_queue,
        request_timeout=args.request_timeout,
    )
    try:
        server = Server(pg, args.host, args.port, args.allow_host, args.graceful_timeout)
        pg.served.warm_up()  # after the port is bound and every option checked: a bad one fails before the compile
    except StemlmError:
        pg.close()
        raise
    if not _is_loopback(args.host):
        warning = f"listening on {args.host}: reachable from other machines, and the server has no login"
        print(f"stemlm serve: warning: {warning}", file=sys.stderr)
    print(f"stemlm serve: {pg.served.name} at {server.url}/v1 (the OpenAI-compatible API)", file=sys.stderr)
    print(f"stemlm serve: the playground at {server.url}/ (Ctrl-C stops)", file=sys.stderr)
    server.serve_forever()
    print("stemlm serve: stopped", file=sys.stderr)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        aliases=["server"],
        help="web playground and OpenAI-compatible API in one server (generate, STEM contributions, edits)",
        description="Serve a web page to generate from a checkpoint, see each position's STEM contribution per "
        "layer and nearest tokens, and try entity edits before/after, and the OpenAI-compatible /v1/models, "
        "/v1/completions and /v1/chat/completions (streamed or not) and /metrics, all from one batched decode "
        "loop; on loopback by default. `stemlm server` is the same command.",
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
        "--compile",
        action=argparse.BooleanOptionalAction,
        help="run the batched decoding steps through torch.compile, dynamic in batch size and length, compiled at "
        "start (a minute or more on a CPU) before the server listens; default: on with --tables resident (or device), "
        "off with host / mmap (their rows come from Python code, which the compiler cannot trace)",
    )
    p.add_argument(
        "--save-dir",
        metavar="DIR",
        help="folder where the page may save globally edited checkpoints, one new subfolder each (off if unset)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap every page prompt as a user turn with the checkpoint's chat template (e.g. an imported instruct "
        "GGUF); the API's /v1/chat/completions uses the template whether or not this is set",
    )
    p.add_argument("--served-model-name", help="the model id API clients send (default: the checkpoint folder's name)")
    p.add_argument(
        "--slots",
        type=int,
        default=128,
        help="sequences decoded at once, the KV-pool rows (each prompt and choice of a request counts; the pool "
        "grows with use, so idle slots hold no memory; default 128)",
    )
    p.add_argument(
        "--step-tokens",
        type=int,
        default=64,
        help="token budget of one engine step: one per decoding sequence plus prompt tokens prefilled in chunks "
        "(default 64)",
    )
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429 (default 64)")
    p.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds before an API request is cancelled (default 600)"
    )
    p.add_argument(
        "--graceful-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may finish after Ctrl-C / SIGTERM before they are cancelled (default 30)",
    )
    p.set_defaults(func=run)
