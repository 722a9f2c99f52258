"""The port allocator: never in the kernel's ephemeral range, never a port something listens on,
never the same port to two runs at once; and the launcher moves a server whose port was taken to
a fresh one, once, saying so."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from turbowire.serving.launch import start_proxy
from turbowire.serving.ports import (
    PortAllocator,
    PortsExhaustedError,
    candidate_ranges,
    ephemeral_range,
    free_port,
)


def test_candidates_leave_out_the_ephemeral_range() -> None:
    assert candidate_ranges((32768, 60999)) == [range(20000, 32768), range(61000, 65536)]
    assert candidate_ranges((10000, 65535)) == [range(20000, 65536)]  # nothing outside: all
    assert candidate_ranges((20000, 30000), floor=20000) == [range(30001, 65536)]


def test_the_kernels_range_is_read_and_a_bad_file_falls_back(tmp_path: Path) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ephemeral_range(f) == (40000, 50000)
    f.write_text("garbage")
    assert ephemeral_range(f) == (32768, 60999)
    assert ephemeral_range(tmp_path / "missing") == (32768, 60999)


def test_free_ports_are_outside_this_machines_ephemeral_range_and_distinct() -> None:
    lo, hi = ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert not [p for p in ports if lo <= p <= hi]


def _narrow(tmp_path: Path, lo: int, n: int) -> PortAllocator:
    """An allocator over ports lo..lo+n-1 only (the ephemeral range placed above them)."""
    return PortAllocator(tmp_path / "ports.lock", floor=lo, ceiling=lo + n - 1,
                         ephemeral=(lo + n, lo + n + 10))


def _base(n: int) -> int:
    """n consecutive ports nothing listens on now (checked, not assumed)."""
    anchor = free_port()  # reserved for this process: no other turbowire run takes it
    start = anchor - anchor % 64
    return start if start >= 20000 else start + 64


def test_a_port_something_listens_on_is_never_handed_out(tmp_path: Path) -> None:
    lo = _base(4)
    with socket.socket() as s:
        s.bind(("127.0.0.1", lo + 1))
        s.listen()
        got = set()
        alloc = _narrow(tmp_path, lo, 4)
        for _ in range(3):
            got.add(alloc.reserve())
        assert lo + 1 not in got and len(got) == 3
        with pytest.raises(PortsExhaustedError, match="no free port"):
            alloc.reserve()


def test_two_processes_never_share_a_port_and_release_gives_one_back(tmp_path: Path) -> None:
    lo, n = _base(8), 8
    child = subprocess.Popen(
        [sys.executable, "-c", (
            "import json, sys\n"
            "from pathlib import Path\n"
            "from turbowire.serving.ports import PortAllocator\n"
            f"a = PortAllocator(Path({str(tmp_path / 'ports.lock')!r}), floor={lo}, "
            f"ceiling={lo + n - 1}, ephemeral=({lo + n}, {lo + n + 10}))\n"
            "print(json.dumps([a.reserve() for _ in range(4)]), flush=True)\n"
            "sys.stdin.read()\n"  # holds its reservations until told to exit
        )],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout is not None
        theirs = set(json.loads(child.stdout.readline()))
        alloc = _narrow(tmp_path, lo, n)
        mine = {alloc.reserve() for _ in range(4)}
        assert len(theirs) == 4 and len(mine) == 4 and not theirs & mine
        with pytest.raises(PortsExhaustedError):
            alloc.reserve()
        alloc.release(min(mine))
        assert alloc.reserve() == min(mine)
    finally:
        child.communicate("", timeout=30)
    # the child's locks went with it: its ports are the four left
    assert {alloc.reserve() for _ in range(4)} == theirs


def test_a_server_whose_port_was_taken_is_started_once_more_on_a_fresh_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The real proxy (uvicorn), given a port another process listens on, dies with errno 98:
    the launcher starts it again on a fresh port, logs that it did, keeps the first log."""
    taken = free_port()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", taken))
        s.listen()
        proc = start_proxy(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], taken, tmp_path)
        try:
            with caplog.at_level(logging.WARNING, "turbowire.serving.launch"):
                proc.wait_healthy(120, path="/metrics")  # /health needs engines
            assert proc.url != f"http://127.0.0.1:{taken}"
            assert "retrying once" in caplog.text and str(taken) in caplog.text
            first = proc.log_path.with_name(proc.log_path.name + ".port-clash")
            assert "address already in use" in first.read_text().lower()
            assert proc.on_port_clash is None  # once only
        finally:
            proc.stop()
