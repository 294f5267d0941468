"""A TCP proxy that cuts a link on command and adds latency: what netem cannot give us here.

    proxy = FaultProxy(upstream=("127.0.0.1", 50051)); proxy.start()
    # point the learner at 127.0.0.1:proxy.port
    proxy.cut()      # drop every open connection and refuse new ones
    proxy.restore()  # let connections through again

    python -m deploy.faultproxy --listen 10.231.1.1:50051 --upstream 127.0.0.1:50052 \
        --delay-ms 50     # as a process (deploy/wan_sim.py runs one per link)

With `delay_s`, every chunk is held that long in each direction before it is forwarded (a
one-way latency; bandwidth is left to the link, e.g. a tbf qdisc). Listens on loopback unless
told otherwise and forwards only to the upstream it was given.
"""

from __future__ import annotations

import argparse
import collections
import logging
import signal
import socket
import threading
import time

log = logging.getLogger(__name__)

_BUFFER = 1 << 16


class FaultProxy:
    def __init__(
        self,
        upstream: tuple[str, int],
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        delay_s: float = 0.0,
    ) -> None:
        self.upstream = upstream
        self.delay_s = delay_s
        self._listener = socket.create_server((listen_host, listen_port))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._cut = False
        self._closed = False
        self.cuts = 0

    def start(self) -> None:
        threading.Thread(target=self._accept, name=f"proxy-{self.port}", daemon=True).start()

    def cut(self) -> None:
        """Break the link: close every open connection, refuse new ones until restore()."""
        with self._lock:
            self._cut = True
            self.cuts += 1
            doomed, self._connections = self._connections, set()
        for sock in doomed:
            _close(sock)

    def restore(self) -> None:
        with self._lock:
            self._cut = False

    def close(self) -> None:
        self._closed = True
        self.cut()
        _close(self._listener)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                refused = self._cut
            if refused:
                _close(client)
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._connections |= {client, server}
            pump = self._pump_delayed if self.delay_s > 0 else self._pump
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(_BUFFER):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._drop(src, dst)

    def _pump_delayed(self, src: socket.socket, dst: socket.socket) -> None:
        """Read as data comes; a second thread sends each chunk delay_s after it arrived."""
        queue: collections.deque[tuple[float, bytes]] = collections.deque()
        ready = threading.Condition()

        def send() -> None:
            try:
                while True:
                    with ready:
                        while not queue:
                            ready.wait()
                        due, data = queue.popleft()
                    if not data:
                        return  # end of stream, after everything before it
                    time.sleep(max(0.0, due - time.monotonic()))
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                self._drop(src, dst)

        threading.Thread(target=send, daemon=True).start()
        data = b""
        try:
            while data := src.recv(_BUFFER):
                with ready:
                    queue.append((time.monotonic() + self.delay_s, data))
                    ready.notify()
        except OSError:
            pass
        finally:
            with ready:
                queue.append((0.0, b""))
                ready.notify()

    def _drop(self, src: socket.socket, dst: socket.socket) -> None:
        for sock in (src, dst):
            _close(sock)
        with self._lock:
            self._connections -= {src, dst}


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="A TCP proxy with added one-way latency.")
    parser.add_argument("--listen", required=True, help="host:port to accept connections on")
    parser.add_argument("--upstream", required=True, help="host:port to forward them to")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way added latency")
    args = parser.parse_args()
    (host, _, port), (up_host, _, up_port) = (
        args.listen.rpartition(":"),
        args.upstream.rpartition(":"),
    )
    if not port.isdigit() or not up_port.isdigit() or args.delay_ms < 0:
        parser.exit(2, "faultproxy: error: --listen/--upstream must be host:port, delay >= 0\n")
    proxy = FaultProxy((up_host, int(up_port)), host, int(port), args.delay_ms / 1000)
    proxy.start()
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    proxy.close()


if __name__ == "__main__":
    main()
