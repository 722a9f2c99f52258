"""TCP ports for the processes turbowire starts on one machine: the demo, the soak run, the
benchmarks and the tests.

A port found by binding port 0 and closing the socket is an *ephemeral* port: the kernel hands
the same range to every outgoing connection and to every other program that binds port 0 (vLLM,
UCX and gRPC all do), so by the time an engine binds it seconds later someone else may hold it.
The allocator therefore picks from outside the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), checks that nothing listens there now, and keeps
each port reserved for the life of the process with a one-byte lock at the port's offset in one
shared lock file, so two runs on one machine (CI beside a demo, two pytest sessions) never hand
out the same port. The locks go away with the process that took them; nothing to clean up.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import random
import socket
import tempfile
import threading
from pathlib import Path

from turbowire.errors import TurboWireError

logger = logging.getLogger(__name__)

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOCK_PATH = Path(tempfile.gettempdir()) / "turbowire-ports.lock"
#: Below this: ports people start services on by hand (8000, 8080, 9090, 6379, ...).
FLOOR = 20000
CEILING = 65535
#: Linux's default ephemeral range, used where the kernel's file cannot be read.
DEFAULT_EPHEMERAL = (32768, 60999)


class PortsExhaustedError(TurboWireError, RuntimeError):
    """No port outside the ephemeral range was free and unreserved."""


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (inclusive), or Linux's default if unreadable."""
    try:
        lo, hi = (int(x) for x in path.read_text().split()[:2])
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return (lo, hi) if 0 < lo <= hi <= CEILING else DEFAULT_EPHEMERAL


def candidate_ranges(
    ephemeral: tuple[int, int], floor: int = FLOOR, ceiling: int = CEILING
) -> list[range]:
    """Ports in [floor, ceiling] outside ``ephemeral``; all of [floor, ceiling] if none are."""
    lo, hi = ephemeral
    out = [r for r in (range(floor, min(lo, ceiling + 1)), range(max(hi + 1, floor), ceiling + 1))
           if len(r)]
    return out or [range(floor, ceiling + 1)]


def listening_anywhere(port: int) -> bool:
    """True when a socket holds ``port`` on some address (binding the wildcard fails)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # servers set SO_REUSEADDR (uvicorn, gRPC): a TIME_WAIT left by an old connection
        # does not stop them, so it must not stop this check either
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return True
            raise
    return False


class PortAllocator:
    """Hands out ports no other turbowire run on this machine holds, outside the ephemeral
    range, each once per process."""

    def __init__(self, lock_path: Path = LOCK_PATH, floor: int = FLOOR,
                 ceiling: int = CEILING, ephemeral: tuple[int, int] | None = None) -> None:
        self.lock_path = lock_path
        self.ephemeral = ephemeral or ephemeral_range()
        self.ranges = candidate_ranges(self.ephemeral, floor, ceiling)
        self._held: set[int] = set()
        self._mutex = threading.Lock()
        self._fd: int | None = None
        self._rng = random.Random()
        if self.ranges == [range(floor, ceiling + 1)] and self.ephemeral[0] <= floor:
            logger.warning(
                "the kernel's ephemeral port range %d-%d covers every port from %d: ports handed "
                "out may be taken by outgoing connections (engines retry once)",
                *self.ephemeral, floor,
            )

    @property
    def size(self) -> int:
        return sum(len(r) for r in self.ranges)

    def _lock_fd(self) -> int | None:
        if self._fd is None:
            try:
                self._fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as exc:
                logger.warning("cannot open %s (%s): ports are not reserved across runs",
                               self.lock_path, exc)
                self._fd = -1
        return None if self._fd < 0 else self._fd

    def _try_lock(self, port: int) -> bool:
        fd = self._lock_fd()
        if fd is None:
            return True
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port, os.SEEK_SET)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EAGAIN):
                return False  # another process (another run) holds it
            raise
        return True

    def _unlock(self, port: int) -> None:
        fd = self._lock_fd()
        if fd is not None:
            fcntl.lockf(fd, fcntl.LOCK_UN, 1, port, os.SEEK_SET)

    def reserve(self) -> int:
        """A port reserved for this process until it exits (or :meth:`release`)."""
        with self._mutex:
            # a scan from a random place: every candidate once, up to 4096 tries
            start = self._rng.randrange(self.size)
            for i in range(min(self.size, 4096)):
                port = self._port_at((start + i) % self.size)
                if port in self._held or not self._try_lock(port):
                    continue
                if listening_anywhere(port):
                    self._unlock(port)
                    continue
                self._held.add(port)
                return port
        raise PortsExhaustedError(
            f"no free port in {', '.join(f'{r.start}-{r.stop - 1}' for r in self.ranges)} "
            f"(outside the ephemeral range {self.ephemeral[0]}-{self.ephemeral[1]})"
        )

    def _port_at(self, index: int) -> int:
        for r in self.ranges:
            if index < len(r):
                return r[index]
            index -= len(r)
        raise IndexError(index)

    def release(self, port: int) -> None:
        """Give ``port`` back before the process exits (its listener is gone)."""
        with self._mutex:
            if port in self._held:
                self._held.discard(port)
                self._unlock(port)


_ALLOCATOR: PortAllocator | None = None
_ALLOCATOR_MUTEX = threading.Lock()


def allocator() -> PortAllocator:
    """The process's one allocator."""
    global _ALLOCATOR
    with _ALLOCATOR_MUTEX:
        if _ALLOCATOR is None:
            _ALLOCATOR = PortAllocator()
        return _ALLOCATOR


def free_port() -> int:
    """A TCP port for a server this run is about to start: outside the kernel's ephemeral range,
    free now, and reserved against every other turbowire run on this machine."""
    return allocator().reserve()
