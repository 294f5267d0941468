"""A TCP proxy that can cut a link on command: the network faults that netem cannot give us.

    proxy = FaultProxy(upstream=("127.0.0.1", 50051)); proxy.start()
    # point the learner at 127.0.0.1:proxy.port
    proxy.cut()      # drop every open connection and refuse new ones
    proxy.restore()  # let connections through again

Listens on loopback only and forwards only to the upstream it was given.
"""

from __future__ import annotations

import logging
import socket
import threading

log = logging.getLogger(__name__)

_BUFFER = 1 << 16


class FaultProxy:
    def __init__(self, upstream: tuple[str, int], listen_host: str = "127.0.0.1") -> None:
        self.upstream = upstream
        self._listener = socket.create_server((listen_host, 0))
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
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(_BUFFER):
                dst.sendall(data)
        except OSError:
            pass
        finally:
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
