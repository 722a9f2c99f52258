"""A real bandwidth-limited network link between two "hosts" on one machine.

The decode engine runs in its own network namespace joined to the root namespace by a veth pair;
both ends get a ``tbf`` qdisc (``netem`` is not in this kernel), so traffic in either direction is
shaped to the same rate. NIXL/UCX over TCP then crosses a link with a real rate limit, queueing and
TCP congestion control, instead of loopback.

Names carry the owning process id (``tw-e2e-<pid>``, ``twe<pid>r``/``twe<pid>n``) so two runs never
touch each other's links, and links whose owner died are removed at the next start. Only addresses
of the namespace made here are used. Needs root (``ip``/``tc``).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from types import TracebackType

from turbowire.errors import TurboWireError

logger = logging.getLogger(__name__)

NS_PREFIX = "tw-e2e-"
IF_PREFIX = "twe"
_NS_RE = re.compile(rf"^{re.escape(NS_PREFIX)}(\d+)$")
_IF_RE = re.compile(rf"^{IF_PREFIX}(\d+)[rn](@\S+)?$")


class LinkError(TurboWireError, RuntimeError):
    """Creating, shaping or measuring the emulated link failed."""


def _run(cmd: list[str], *, check: bool = True, netns: str | None = None) -> str:
    if netns is not None:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise LinkError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def tbf_params(rate_gbit: float) -> tuple[int, int]:
    """(burst bytes, queue limit bytes) for a tbf at ``rate_gbit``.

    The bucket must hold at least one kernel tick of traffic (HZ may be as low as 100, i.e. 10 ms)
    or tbf cannot reach its rate; the queue holds ~50 ms so TCP sees a realistic bottleneck buffer.
    """
    if rate_gbit <= 0:
        raise ValueError(f"rate_gbit must be > 0, got {rate_gbit}")
    bytes_per_s = rate_gbit * 1e9 / 8
    burst = max(256 * 1024, int(bytes_per_s * 0.010))
    limit = max(burst + 64 * 1024, int(bytes_per_s * 0.050))
    return burst, limit


@dataclass(frozen=True)
class LinkConfig:
    """Names and addresses of one emulated link; defaults are unique per process."""

    owner_pid: int = field(default_factory=os.getpid)
    subnet_octet: int | None = None  # third octet of 10.231.X.0/30; derived from the pid if None
    mtu: int = 1500

    def __post_init__(self) -> None:
        if self.owner_pid <= 0:
            raise ValueError(f"owner_pid must be a positive process id, got {self.owner_pid}")
        if self.subnet_octet is not None and not 0 <= self.subnet_octet <= 255:
            raise ValueError(f"subnet_octet must be within 0..255, got {self.subnet_octet}")
        if not 576 <= self.mtu <= 65535:
            raise ValueError(f"mtu must be within 576..65535, got {self.mtu}")
        if len(self.root_if) > 15:
            raise ValueError(
                f"interface name {self.root_if!r} exceeds 15 characters; use a smaller pid")

    @property
    def netns(self) -> str:
        return f"{NS_PREFIX}{self.owner_pid}"

    @property
    def root_if(self) -> str:
        return f"{IF_PREFIX}{self.owner_pid}r"

    @property
    def ns_if(self) -> str:
        return f"{IF_PREFIX}{self.owner_pid}n"

    @property
    def _octet(self) -> int:
        return self.subnet_octet if self.subnet_octet is not None else self.owner_pid % 250

    @property
    def root_addr(self) -> str:
        return f"10.231.{self._octet}.1"

    @property
    def ns_addr(self) -> str:
        return f"10.231.{self._octet}.2"


def cleanup_stale() -> list[str]:
    """Delete namespaces and veths made by earlier runs whose owning process is gone."""
    removed: list[str] = []
    for line in _run(["ip", "netns", "list"], check=False).splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NS_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    for line in _run(["ip", "-o", "link", "show"], check=False).splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip()
        m = _IF_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _run(["ip", "link", "del", name.split("@")[0]], check=False)
            removed.append(name.split("@")[0])
    if removed:
        logger.info("removed stale links/namespaces: %s", removed)
    return removed


class EmulatedLink:
    """Context manager owning one netns + veth pair with tbf shaping on both ends.

    Usage::

        with EmulatedLink() as link:
            link.set_rate(1.0)          # Gbit/s; None = unshaped
            subprocess.run(link.netns_cmd(["python", "server.py"]))
    """

    def __init__(self, config: LinkConfig | None = None) -> None:
        self.config = config or LinkConfig()
        self.rate_gbit: float | None = None
        self._up = False

    # -- lifecycle -------------------------------------------------------------------------
    def create(self) -> "EmulatedLink":
        if os.geteuid() != 0:
            raise LinkError("the emulated link needs root (ip netns / tc); run as root")
        cleanup_stale()
        c = self.config
        self._teardown_quiet()
        try:
            _run(["ip", "netns", "add", c.netns])
            self._up = True
            _run(["ip", "link", "add", c.root_if, "type", "veth", "peer", "name", c.ns_if])
            _run(["ip", "link", "set", c.ns_if, "netns", c.netns])
            _run(["ip", "addr", "add", f"{c.root_addr}/30", "dev", c.root_if])
            _run(["ip", "link", "set", c.root_if, "mtu", str(c.mtu), "up"])
            _run(["ip", "addr", "add", f"{c.ns_addr}/30", "dev", c.ns_if], netns=c.netns)
            _run(["ip", "link", "set", c.ns_if, "mtu", str(c.mtu), "up"], netns=c.netns)
            _run(["ip", "link", "set", "lo", "up"], netns=c.netns)
        except Exception:
            self.teardown()
            raise
        logger.info("link up: %s (%s) <-> %s:%s (%s)", c.root_if, c.root_addr, c.netns, c.ns_if,
                    c.ns_addr)
        return self

    def _teardown_quiet(self) -> None:
        c = self.config
        _run(["ip", "netns", "del", c.netns], check=False)
        _run(["ip", "link", "del", c.root_if], check=False)

    def teardown(self) -> None:
        """Remove the namespace and both veth ends (idempotent)."""
        self._teardown_quiet()
        self._up = False
        self.rate_gbit = None

    def __enter__(self) -> "EmulatedLink":
        return self.create()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.teardown()

    # -- shaping ---------------------------------------------------------------------------
    def set_rate(self, rate_gbit: float | None) -> None:
        """Shape both directions to ``rate_gbit`` Gbit/s (tbf), or remove shaping with None.

        Uses ``tc qdisc replace`` so it can be changed while engines keep their connections.
        """
        c = self.config
        for dev, ns in ((c.root_if, None), (c.ns_if, c.netns)):
            if rate_gbit is None:
                _run(["tc", "qdisc", "del", "dev", dev, "root"], check=False, netns=ns)
                continue
            burst, limit = tbf_params(rate_gbit)
            _run(["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                  f"{int(rate_gbit * 1e6)}kbit", "burst", str(burst), "limit", str(limit)],
                 netns=ns)
        self.rate_gbit = rate_gbit
        logger.info("link rate: %s", "unshaped" if rate_gbit is None else f"{rate_gbit} Gbit/s")

    def qdisc(self) -> str:
        """The root-side qdisc as ``tc`` shows it (for logs and tests)."""
        return _run(["tc", "qdisc", "show", "dev", self.config.root_if]).strip()

    # -- helpers ---------------------------------------------------------------------------
    def netns_cmd(self, cmd: list[str]) -> list[str]:
        """Prefix ``cmd`` so it runs inside the decode namespace."""
        return ["ip", "netns", "exec", self.config.netns, *cmd]

    def counters(self) -> tuple[int, int]:
        """(tx_bytes, rx_bytes) of the root-side veth: every byte that crossed the link."""
        base = f"/sys/class/net/{self.config.root_if}/statistics"
        with open(f"{base}/tx_bytes") as f_tx, open(f"{base}/rx_bytes") as f_rx:
            return int(f_tx.read()), int(f_rx.read())

    def measure_gbit(self, nbytes: int = 32 << 20, port: int = 0, timeout: float = 60.0) -> float:
        """Send ``nbytes`` over TCP from the root namespace to a sink in the namespace.

        Returns the goodput in Gbit/s measured at the receiver (first byte to last byte), which is
        what a bulk NIXL transfer sees.
        """
        c = self.config
        sink = subprocess.Popen(
            self.netns_cmd([sys.executable, "-c", _SINK_SRC, c.ns_addr, str(port)]),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert sink.stdout is not None
            line = sink.stdout.readline().strip()
            if not line.startswith("PORT "):
                raise LinkError(f"throughput sink did not start: {line!r} {sink.stderr.read()}")
            sink_port = int(line.split()[1])
            payload = b"\0" * (1 << 20)
            with socket.create_connection((c.ns_addr, sink_port), timeout=timeout) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
                sent = 0
                while sent < nbytes:
                    chunk = payload[: min(len(payload), nbytes - sent)]
                    s.sendall(chunk)
                    sent += len(chunk)
                s.shutdown(socket.SHUT_WR)
                out, err = sink.communicate(timeout=timeout)
        finally:
            if sink.poll() is None:
                sink.kill()
                sink.wait()
        fields = out.split()
        if len(fields) != 3 or fields[0] != "RESULT":
            raise LinkError(f"throughput sink failed: {out!r} {err!r}")
        got, secs = int(fields[1]), float(fields[2])
        if got != nbytes:
            raise LinkError(f"sink received {got} bytes, expected {nbytes}")
        return got * 8 / secs / 1e9


# Receiver run inside the namespace: prints its port, then bytes and seconds from first to last
# byte.
_SINK_SRC = r"""
import socket, sys, time
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], int(sys.argv[2]))); srv.listen(1)
print("PORT", srv.getsockname()[1], flush=True)
conn, _ = srv.accept(); conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
buf = bytearray(1 << 20); total = 0; t0 = None
while True:
    n = conn.recv_into(buf)
    if not n:
        break
    if t0 is None:
        t0 = time.perf_counter()
    total += n
    t1 = time.perf_counter()
print("RESULT", total, t1 - t0, flush=True)
"""


def _rate(text: str) -> float | None:
    return None if text == "none" else float(text)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.e2e.link [rates...]``: create a link, measure each rate, remove it."""
    ap = argparse.ArgumentParser(
        prog="python -m bench.e2e.link",
        description="Create a rate-limited veth link (needs root), measure each rate over it, "
                    "remove it.")
    ap.add_argument("rates", nargs="*", type=_rate, default=[0.2, 1.0, 10.0, None],
                    help="Gbit/s per measurement, 'none' for unshaped (default: 0.2 1 10 none)")
    rates: list[float | None] = ap.parse_args(argv).rates
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    with EmulatedLink() as link:
        for rate in rates:
            link.set_rate(rate)
            t0 = time.perf_counter()
            size = 16 << 20 if (rate or 100) < 1 else 128 << 20
            got = link.measure_gbit(size)
            logger.info("configured %-9s measured %.3f Gbit/s (%.1f s)",
                        "unshaped" if rate is None else f"{rate} Gbit/s", got,
                        time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
