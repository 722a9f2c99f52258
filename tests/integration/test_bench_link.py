"""The benchmark's emulated link is really shaped: TCP goodput over the veth matches tbf's rate.

Real network namespace, veth pair and tbf qdiscs (needs root, as the benchmark does); a few MB
sent with a plain TCP socket from the root namespace to a sink inside the namespace.
"""

from __future__ import annotations

import subprocess

import pytest

from turbowire.bench_e2e.link import EmulatedLink, LinkConfig, cleanup_stale

pytestmark = pytest.mark.integration


def _netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _links() -> str:
    return subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout


def test_tbf_shapes_tcp_goodput_and_teardown_removes_everything() -> None:
    link = EmulatedLink()
    with link:
        assert link.config.netns in _netns_names()
        link.set_rate(0.2)
        assert "tbf" in link.qdisc() and "200Mbit" in link.qdisc()
        slow = link.measure_gbit(6 << 20)
        link.set_rate(1.0)
        fast = link.measure_gbit(24 << 20)
        link.set_rate(None)
        assert "tbf" not in link.qdisc()
        unshaped = link.measure_gbit(64 << 20)
        tx, rx = link.counters()
        assert tx > 90 << 20  # the bytes really crossed the veth
    assert 0.15 <= slow <= 0.21, slow
    assert 0.75 <= fast <= 1.05, fast
    assert unshaped > 1.5 * fast, (unshaped, fast)
    assert link.config.netns not in _netns_names()
    assert link.config.root_if not in _links()


def test_stale_links_of_dead_owners_are_removed() -> None:
    # a pid that cannot be alive (above the kernel's pid_max default of 4194304)
    dead = LinkConfig(owner_pid=4194999, subnet_octet=251)
    link = EmulatedLink(dead)
    link.create()  # create() itself runs cleanup_stale first; this one stays behind
    try:
        assert dead.netns in _netns_names()
        removed = cleanup_stale()
        assert dead.netns in removed
        assert dead.netns not in _netns_names()
        assert dead.root_if not in _links()
    finally:
        link.teardown()
