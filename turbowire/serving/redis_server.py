"""A real ``redis-server`` on loopback, for the demo, benchmarks and tests.

Why: the store's failure handling (Redis killed mid-traffic, restarted on the same address, keys
expiring) is only trustworthy against a real server. This starts ``redis-server`` without
persistence in a temporary directory on a free port and waits until it answers ``PING``::

    with RedisServer() as redis:
        client = redis_py.Redis.from_url(redis.url)
        redis.kill()      # SIGKILL: clients see a dead peer
        redis.start()     # again on the same port, empty

For pytest::

    @pytest.fixture
    def redis_server():
        yield from redis_server_fixture()
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

from turbowire.errors import TurboWireError
from turbowire.serving.ports import free_port

logger = logging.getLogger(__name__)


class RedisServerError(TurboWireError, RuntimeError):
    """redis-server could not be found or started."""


def redis_binary() -> str:
    for candidate in (shutil.which("redis-server"), "/usr/bin/redis-server"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise RedisServerError("redis-server is not installed (Debian package 'redis-server')")


def _resp(*words: bytes) -> bytes:
    """One RESP command (an array of bulk strings)."""
    return b"".join([b"*%d\r\n" % len(words)] + [b"$%d\r\n%s\r\n" % (len(w), w) for w in words])


def _ping(port: int, timeout: float = 0.2, password: str | None = None) -> bool:
    """A raw RESP PING (after AUTH with a password), so this helper needs no client library."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            if password is not None:
                s.sendall(_resp(b"AUTH", password.encode()))
                if not s.recv(64).startswith(b"+OK"):
                    return False
            s.sendall(_resp(b"PING"))
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process; ``start()`` after ``stop()``/``kill()`` reuses the same port."""

    def __init__(self, port: int | None = None, *, ready_timeout_s: float = 10.0,
                 extra_args: tuple[str, ...] = (), password: str | None = None) -> None:
        """``password``: the server requires it (``requirepass``, written to a config file in
        its directory, so it is not in the process's arguments); ``url`` never carries it."""
        self.port = port if port is not None else free_port()
        self.password = password
        self._may_move = port is None  # a port of its own choosing: a clash picks another, once
        self.ready_timeout_s = ready_timeout_s
        self.extra_args = extra_args
        self._dir = Path(tempfile.mkdtemp(prefix="turbowire-redis-"))
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = self._dir / "redis.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> RedisServer:
        """Start (or restart) the server and wait until it answers PING."""
        if self.running:
            return self
        deadline = time.monotonic() + self.ready_timeout_s
        conf: list[str] = []
        if self.password is not None:
            path = self._dir / "auth.conf"
            escaped = self.password.replace("\\", "\\\\").replace('"', '\\"')
            path.write_text(f'requirepass "{escaped}"\n')
            path.chmod(0o600)
            conf = [str(path)]  # redis-server reads a config file only as its first argument
        while True:
            cmd = [
                redis_binary(), *conf, "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self._dir),
                "--logfile", str(self._log), "--daemonize", "no", *self.extra_args,
            ]
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, cwd=self._dir,
            )
            while time.monotonic() < deadline and self._proc.poll() is None:
                if _ping(self.port, password=self.password):
                    self._may_move = False  # clients hold its URL from now on
                    logger.debug("redis-server up on port %d (pid %d)", self.port, self._proc.pid)
                    return self
                time.sleep(0.02)
            if self._proc.poll() is None or time.monotonic() >= deadline:
                break
            if self._may_move and "Address already in use" in self._read_log():
                self._may_move = False
                old, self.port = self.port, free_port()
                logger.warning("redis-server could not bind port %d (in use): retrying once on "
                               "port %d", old, self.port)
                continue
            # It exited: on a restart the port can still be held briefly by the old socket.
            time.sleep(0.1)
        self._terminate(signal.SIGKILL)
        raise RedisServerError(
            f"redis-server did not answer PING on port {self.port} within "
            f"{self.ready_timeout_s:.0f}s; log:\n{self._read_log()}"
        )

    def _read_log(self) -> str:
        try:
            return self._log.read_text(errors="replace")[-4000:]
        except OSError:
            return "(no log)"

    def _terminate(self, sig: int) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5.0)

    def stop(self) -> None:
        """Graceful stop (SIGTERM)."""
        self._terminate(signal.SIGTERM)

    def kill(self) -> None:
        """Abrupt death (SIGKILL), as a crashed or partitioned server looks to clients."""
        self._terminate(signal.SIGKILL)

    def cleanup(self) -> None:
        """Stop the server and remove its directory."""
        self.kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.cleanup()


def redis_server_fixture(**kwargs: object) -> Iterator[RedisServer]:
    """Body of a pytest fixture: ``yield from redis_server_fixture()``."""
    server = RedisServer(**kwargs)  # type: ignore[arg-type]
    try:
        yield server.start()
    finally:
        server.cleanup()
