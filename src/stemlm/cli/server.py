"""`stemlm server CKPT`: an OpenAI-compatible API (completions, chat, streaming) with continuous batching.

    stemlm server runs/tiny                                  # http://127.0.0.1:8000/v1
    stemlm server runs/tiny --tables host --cache-fraction 0.2 --slots 16 --max-queue 64
    curl -s 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "tiny", "prompt": "The capital of Spain is", "max_tokens": 8, "temperature": 0,
             "stem_edit": {"source": "Spain", "target": "Germany"}}'

It listens on loopback unless --host says otherwise and has no authentication. Ctrl-C (or SIGTERM) stops it
gracefully: no new connections, in-flight requests finish for up to --graceful-timeout seconds. See
docs/serving.md. Needs FastAPI and uvicorn: pip install fastapi uvicorn prometheus-client.
"""

from __future__ import annotations

import sys

from stemlm.cli.common import add_inference_flags
from stemlm.errors import StemlmError


def run(args) -> int:
    try:
        from stemlm.serve.openai_run import ApiServer
        from stemlm.serve.openai_service import ApiService
    except ImportError as exc:
        raise StemlmError(
            f"stemlm server needs FastAPI and uvicorn ({exc.name} is missing): "
            "pip install fastapi uvicorn prometheus-client"
        ) from None
    from stemlm.inference.load import InferenceOptions

    for flag, value, low in (("--slots", args.slots, 1), ("--max-queue", args.max_queue, 0)):
        if value < low:
            raise StemlmError(f"{flag} must be >= {low}, got {value}")
    if not 0 <= args.port <= 65535:
        raise StemlmError(f"--port {args.port} is outside 0..65535 (0 picks a free one)")
    if not args.request_timeout > 0 or not args.graceful_timeout >= 0:
        raise StemlmError("--request-timeout must be > 0 and --graceful-timeout >= 0 seconds")
    service = ApiService.load(
        args.ckpt,
        InferenceOptions.from_args(args),
        name=args.served_model_name,
        slots=args.slots,
        max_queue=args.max_queue,
        request_timeout=args.request_timeout,
    )
    try:
        server = ApiServer(service, args.host, args.port, args.allow_host, args.graceful_timeout)
    except StemlmError:
        service.close()
        raise
    if server.host not in ("127.0.0.1", "::1", "localhost"):
        warning = f"listening on {args.host}: reachable from other machines, and the API has no login"
        print(f"stemlm server: warning: {warning}", file=sys.stderr)
    print(f"stemlm server: {service.name} at {server.url}/v1 (Ctrl-C stops)", file=sys.stderr)
    server.serve_forever()
    print("stemlm server: stopped", file=sys.stderr)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "server",
        help="OpenAI-compatible API with continuous batching (completions, chat, streaming, edits per request)",
        description="Serve /v1/models, /v1/completions and /v1/chat/completions (streamed or not) and /metrics "
        "from one batched decode loop; on loopback by default.",
    )
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint folder, or run folder (uses its newest checkpoint)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0 picks a free one)")
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="also answer requests whose Host header is NAME (repeatable; default: loopback names and --host only)",
    )
    add_inference_flags(p)
    p.add_argument(
        "--compile",
        action="store_true",
        help="run the batched decoding steps through torch.compile (resident tables only; the first steps wait "
        "for the compile, again for each new batch shape until it compiles a dynamic one)",
    )
    p.add_argument("--served-model-name", help="the model id clients send (default: the checkpoint folder's name)")
    p.add_argument("--slots", type=int, default=16, help="requests decoded at once, the KV-pool rows (default 16)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429 (default 64)")
    p.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds before a request is cancelled (default 600)"
    )
    p.add_argument(
        "--graceful-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may finish after Ctrl-C / SIGTERM before they are cancelled (default 30)",
    )
    p.set_defaults(func=run)
