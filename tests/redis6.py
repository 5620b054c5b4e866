"""A Redis 6 as a distribution's apt installs it (Ubuntu 22.04, Debian 11: 6.0.16), which the
machine's apt has none of: a TCP proxy to a real Redis whose ``INFO`` says ``redis_version:6.``
where Redis said ``7.`` (the same length: the reply's framing holds); every other byte passes
as it is. In a test (:func:`proxy_saying_version_6`), or run as a ``redis-server`` on ``PATH``
for ``sift up`` and ``sift demo`` to start (:func:`main`).
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading


def proxy_saying_version_6(listener: socket.socket, port: int) -> list[socket.socket]:
    """Accept on ``listener`` (on a daemon thread) and pass each connection to the Redis on
    ``port``, its ``INFO`` saying 6.; the sockets opened, to close. A connection made while
    nothing listens on ``port`` (a Redis not up yet) is closed at once, as one not answering."""
    links: list[socket.socket] = []

    def pipe(src: socket.socket, dst: socket.socket, rewrite: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(
                    data.replace(b"redis_version:7.", b"redis_version:6.") if rewrite else data
                )
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                down, _ = listener.accept()
                try:
                    up = socket.create_connection(("127.0.0.1", port))
                except OSError:  # Redis not up yet: as if it did not answer
                    down.close()
                    continue
                links.extend([down, up])
                threading.Thread(target=pipe, args=(down, up, False), daemon=True).start()
                threading.Thread(target=pipe, args=(up, down, True), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return links


def main() -> None:
    """``redis6.py REAL_REDIS_SERVER ARGS...``: a ``redis-server`` started with ``ARGS``
    (``--port N`` among them) that is the real one on another port behind the proxy on ``N``;
    it ends with the real one, which a SIGTERM or SIGINT stops."""
    real, args = sys.argv[1], sys.argv[2:]
    port = int(args[args.index("--port") + 1])
    with socket.create_server(("127.0.0.1", 0)) as spare:
        inner = spare.getsockname()[1]
    args[args.index("--port") + 1] = str(inner)
    listener = socket.create_server(("127.0.0.1", port))
    server = subprocess.Popen([real, *args])
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: server.terminate())
    proxy_saying_version_6(listener, inner)
    raise SystemExit(server.wait())


if __name__ == "__main__":
    main()
