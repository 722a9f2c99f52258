"""A TCP listener that accepts and never answers: a hung peer, a firewall that drops instead of
refusing, or the host forged params would redirect a decode engine to. ``accepted`` records
every connection, so a test can assert that nothing dialed it."""

from __future__ import annotations

import socket
import threading


class BlackHole:
    """Accepts TCP connections on 127.0.0.1 and never sends a byte."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self._listener.close()
        for conn in self.accepted:
            conn.close()
