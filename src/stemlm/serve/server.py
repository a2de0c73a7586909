"""Running the server's app under uvicorn: in the foreground (`stemlm serve`) or on a thread (tests).

    with Server(Playground.load("runs/tiny"), port=0).running() as server:     # a free loopback port
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")  # and the page at server.url

The socket is bound here, so a taken port is a one-line error. Shutdown is graceful: uvicorn stops accepting
connections, lets the requests in flight finish for up to `graceful_timeout` seconds, then cancels the rest
(each cancelled request frees its slot); `Server.close` then stops the engine loop and the loader.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from stemlm.errors import StemlmError
from stemlm.serve.app import create_app
from stemlm.serve.hosts import trusted_hosts
from stemlm.serve.playground import Playground


def listen(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise StemlmError(f"port {port} is outside 0..65535 (0 picks a free one)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        raise StemlmError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; try another --port") from None


class Server:
    def __init__(
        self,
        pg: Playground,
        host: str = "127.0.0.1",
        port: int = 8000,
        allow_hosts: Sequence[str] = (),
        graceful_timeout: float = 30.0,
    ) -> None:
        import uvicorn

        self.pg, self.service, self.host = pg, pg.served, host
        self.sock = listen(host, port)
        self.port = self.sock.getsockname()[1]
        app = create_app(pg, trusted_hosts(host, allow_hosts))
        config = uvicorn.Config(
            app, log_level="warning", lifespan="off", timeout_graceful_shutdown=graceful_timeout, access_log=False
        )
        self.server = uvicorn.Server(config)
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{shown}:{self.port}"

    def serve_forever(self) -> None:
        """Serve until SIGINT / SIGTERM (uvicorn's handlers, main thread), then shut down gracefully."""
        # After its graceful shutdown uvicorn re-raises the signal it caught at the handler that was there
        # before it; by then the server has stopped, so these handlers end the run instead of the process.
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
        try:
            self.server.run(sockets=[self.sock])
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.close()

    @contextmanager
    def running(self, start_timeout: float = 30.0) -> Iterator[Server]:
        """Serve on a background thread for the duration of the block (uvicorn installs no signal handlers
        off the main thread); leaving the block shuts the server down gracefully and closes the served model."""
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            if not self.server.started:
                raise StemlmError(f"the server did not start within {start_timeout:g} s")
            yield self
        finally:
            self.server.should_exit = True
            self.thread.join()
            self.close()

    def close(self) -> None:
        self.sock.close()
        self.pg.close()
