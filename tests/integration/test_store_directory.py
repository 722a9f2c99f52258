"""Directory (chunk index + engine registry) against a real redis-server.

Why: prefix lookups steer routing and loads, so their edge cases (gaps, a rank missing, junk
written by someone else, a dead Redis) must be checked on the real protocol, not a fake.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator

import pytest
import redis
from support.redis_server import RedisServer, free_port

from turbowire.errors import TurboWireError
from turbowire.store.directory import Directory, DirectoryUnavailable, EngineEntry, StoreUrlError
from turbowire.store.keys import StoreScope

pytestmark = pytest.mark.integration

NS = "twdir"


def scope(tp: int = 2, namespace: str = NS) -> StoreScope:
    return StoreScope(namespace, "tiny-model", "tq3", 1, 256, tp)


def hashes(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


@pytest.fixture
def directory(redis_srv: RedisServer, rds: redis.Redis) -> Iterator[Directory]:
    d = Directory(redis_srv.url, ttl_seconds=30.0)
    yield d
    d.close()


def entry(engine_id: str, sc: StoreScope, role: str = "prefill") -> EngineEntry:
    return EngineEntry(engine_id=engine_id, role=role, side_channel="127.0.0.1:5600",
                       http_url="http://127.0.0.1:8100", scope=sc.to_dict(),
                       record={"codec": "tq3", "layers": [1, 2]})


def test_longest_prefix_gaps_and_missing_ranks(directory: Directory) -> None:
    sc = scope(tp=2)
    hs = hashes(6)
    assert directory.longest_prefix(sc, hs) == 0
    assert directory.longest_prefix(sc, []) == 0
    directory.publish(sc, [(hs[0], 0, 100), (hs[0], 1, 101), (hs[1], 0, 50), (hs[1], 1, 51),
                           (hs[2], 0, 7),  # rank 1 of chunk 2 missing
                           (hs[3], 0, 1), (hs[3], 1, 1)])
    assert directory.longest_prefix(sc, hs) == 2
    assert directory.longest_prefix(sc, hs[:1]) == 1
    assert directory.longest_prefix(sc, hs[1:]) == 1
    assert directory.longest_prefix(sc, hs[3:]) == 1
    assert directory.stored_bytes(sc, hs) == [201, 101, 7, 2, 0, 0]
    directory.publish(sc, [(hs[2], 1, 8)])  # the gap filled: the prefix runs on
    assert directory.longest_prefix(sc, hs) == 4
    # the same chunks under tp 1 are another scope
    assert directory.longest_prefix(scope(tp=1), hs) == 0
    with pytest.raises(TurboWireError):
        directory.publish(sc, [(hs[0], 2, 1)])
    with pytest.raises(TurboWireError):
        directory.publish(sc, [(b"short", 0, 1)])


def test_lookups_never_refresh_only_loads_and_publishes_do(redis_srv: RedisServer,
                                                            rds: redis.Redis) -> None:
    """A lookup (a proxy's or a scheduler's) keeps nothing alive: asking whether a guessed
    prompt is stored must not extend another tenant's entries. An engine that loaded chunks
    refreshes them (touch), a save does (publish)."""
    d = Directory(redis_srv.url, ttl_seconds=1.0)
    sc = scope(tp=1)
    looked, loaded, republished = hashes(3)
    d.publish(sc, [(looked, 0, 1), (loaded, 0, 1), (republished, 0, 1)])
    key = f"{sc.prefix}/{looked.hex()}"
    assert 0 < rds.pttl(key) <= 1000
    time.sleep(0.6)
    for _ in range(3):
        assert d.longest_prefix(sc, [looked, loaded, republished]) == 3
    assert d.stored_bytes(sc, [looked]) == [1]
    assert rds.pttl(key) < 500, "a lookup hit must not refresh the entry"
    d.touch(sc, [loaded])
    d.publish(sc, [(republished, 0, 1)])
    assert rds.pttl(f"{sc.prefix}/{loaded.hex()}") > 900
    assert rds.pttl(f"{sc.prefix}/{republished.hex()}") > 900
    d.touch(sc, [])
    time.sleep(0.6)
    assert d.longest_prefix(sc, [looked]) == 0  # expired while only looked up
    assert d.longest_prefix(sc, [loaded]) == 1
    d.close()


def test_publish_never_rewrites_a_listed_rank(directory: Directory, rds: redis.Redis) -> None:
    sc = scope(tp=2)
    h = os.urandom(16)
    directory.publish(sc, [(h, 0, 100)])
    directory.publish(sc, [(h, 0, 999), (h, 1, 50)])
    assert rds.hgetall(f"{sc.prefix}/{h.hex()}") == {b"r0": b"100", b"r1": b"50"}


def test_forget(directory: Directory) -> None:
    sc = scope(tp=1)
    hs = hashes(3)
    directory.publish(sc, [(h, 0, 10) for h in hs])
    directory.forget(sc, hs[1:2])
    assert directory.longest_prefix(sc, hs) == 1
    assert directory.stored_bytes(sc, hs) == [10, 0, 10]
    directory.forget(sc, [])
    directory.forget(sc, hs)
    assert directory.usage(NS) == (0, 0)


def test_engine_registry_round_trip_and_expiry(directory: Directory) -> None:
    sc = scope()
    t0 = time.time()
    directory.register_engine(entry("prefill-0", sc), ttl_seconds=30)
    directory.register_engine(entry("decode-0", sc, role="decode"), ttl_seconds=0.4)
    directory.register_engine(entry("other", scope(namespace="elsewhere")), ttl_seconds=30)
    got = directory.engines(NS)
    assert [e.engine_id for e in got] == ["decode-0", "prefill-0"]
    p = got[1]
    assert p.role == "prefill" and p.side_channel == "127.0.0.1:5600"
    assert p.http_url == "http://127.0.0.1:8100" and p.record == {"codec": "tq3", "layers": [1, 2]}
    assert StoreScope.from_dict(p.scope) == sc
    assert t0 - 1 <= p.heartbeat <= time.time() + 1
    time.sleep(0.6)
    assert [e.engine_id for e in directory.engines(NS)] == ["prefill-0"]
    assert [e.engine_id for e in directory.engines("elsewhere")] == ["other"]
    with pytest.raises(TurboWireError):
        directory.register_engine(entry("bad/id", sc), ttl_seconds=5)


def test_usage_counts_directory_only(directory: Directory, rds: redis.Redis) -> None:
    sc1, sc2 = scope(tp=1), scope(tp=2)
    h1, h2 = hashes(2)
    directory.publish(sc1, [(h1, 0, 1000)])
    directory.publish(sc2, [(h2, 0, 10), (h2, 1, 20)])
    directory.register_engine(entry("e", sc1), ttl_seconds=30)
    rds.set(sc1.chunk_key(h1, 0), b"blob bytes of tiers.py")  # a blob key next to the entry
    directory.publish(scope(tp=1, namespace="twother"), [(h1, 0, 5)])
    assert directory.usage(NS) == (2, 1030)
    assert directory.usage("twother") == (1, 5)
    assert directory.longest_prefix(sc1, [h1]) == 1
    for key in rds.scan_iter(match="*"):
        assert key.decode().split("/")[0] in (NS, "twother")


def test_malformed_entries_are_skipped(directory: Directory, rds: redis.Redis) -> None:
    sc = scope(tp=1)
    good, neg, text, wrongtype, huge = hashes(5)
    directory.publish(sc, [(good, 0, 3)])
    rds.hset(f"{sc.prefix}/{neg.hex()}", "r0", "-1")
    rds.hset(f"{sc.prefix}/{text.hex()}", "r0", "abc")
    rds.set(f"{sc.prefix}/{wrongtype.hex()}", b"\x80\x04pickle?")  # a string, not a hash
    rds.hset(f"{sc.prefix}/{huge.hex()}", "r0", "9" * 40)
    for bad in (neg, text, wrongtype, huge):
        assert directory.longest_prefix(sc, [bad]) == 0
        assert directory.longest_prefix(sc, [good, bad, good]) == 1
    assert directory.stored_bytes(sc, [good, neg, text, wrongtype, huge]) == [3, 0, 0, 0, 0]
    assert directory.usage(NS) == (1, 3)

    directory.register_engine(entry("ok", sc), ttl_seconds=30)
    registry = f"{NS}/engines"
    valid = json.loads(rds.hget(registry, "ok"))
    junk = {
        "notjson": b"{{{", "binary": os.urandom(40), "list": b"[1,2]",
        "missing": json.dumps({"engine_id": "missing"}).encode(),
        "mismatch": json.dumps({**valid, "engine_id": "someone-else"}).encode(),
        "badscope": json.dumps({**valid, "engine_id": "badscope", "scope": {"x": 1}}).encode(),
        "nan": json.dumps({**valid, "engine_id": "nan"})
        .replace('"heartbeat":', '"heartbeat": NaN, "_":').encode(),
        "badrole": json.dumps({**valid, "engine_id": "badrole", "role": 7}).encode(),
        "expired": json.dumps({**valid, "engine_id": "expired", "expires_at": 1.0}).encode(),
        "noexpiry": json.dumps({k: v for k, v in valid.items() if k != "expires_at"}
                               | {"engine_id": "noexpiry"}).encode(),
        "otherns": json.dumps({**valid, "engine_id": "otherns",
                               "scope": {**valid["scope"], "namespace": "elsewhere"}}).encode(),
    }
    for name, raw in junk.items():
        rds.hset(registry, name, raw)
    assert [e.engine_id for e in directory.engines(NS)] == ["ok"]
    # the next registration drops the long-expired and malformed entries, keeps the rest
    directory.register_engine(entry("ok", sc), ttl_seconds=30)
    left = {k.decode() for k in rds.hkeys(registry)}
    assert left == {"ok", "mismatch", "otherns"}, left
    # a registry key of the wrong type is Redis's error, not a crash
    rds.delete(registry)
    rds.set(registry, b"x")
    with pytest.raises(DirectoryUnavailable):
        directory.engines(NS)
    with pytest.raises(DirectoryUnavailable):
        directory.register_engine(entry("ok", sc), ttl_seconds=30)


def test_registry_is_one_hash_read_without_scan(directory: Directory, rds: redis.Redis,
                                                network_io: list[str]) -> None:
    """L6: reading the registry is one HGETALL, however many chunk keys the namespace holds."""
    sc = scope(tp=1)
    directory.publish(sc, [(h, 0, 1) for h in hashes(300)])
    directory.register_engine(entry("e1", sc), ttl_seconds=30)
    directory.register_engine(entry("e2", sc, role="decode"), ttl_seconds=30)
    assert rds.type(f"{NS}/engines") == b"hash"
    # the registry expires at an absolute time (PEXPIREAT of the client's clock, rounded down to
    # the ms, + 1 ms): read back on Redis's clock it can be up to 30,001 ms away (+1 for rounding)
    assert 0 < rds.pttl(f"{NS}/engines") <= 30_002
    assert not [k for k in rds.scan_iter(match=f"{NS}/engines/*")], "no per-engine keys"
    commands: list[str] = []
    real = redis.Redis.execute_command

    def spy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        commands.append(str(args[0]).upper())
        return real(self, *args, **kwargs)

    redis.Redis.execute_command = spy  # type: ignore[method-assign]
    try:
        assert [e.engine_id for e in directory.engines(NS)] == ["e1", "e2"]
    finally:
        redis.Redis.execute_command = real  # type: ignore[method-assign]
    assert commands == ["HGETALL"], commands
    # a short registration expires on its own; the hash lives as long as its newest entry
    directory.register_engine(entry("brief", sc), ttl_seconds=0.3)
    time.sleep(0.5)
    assert [e.engine_id for e in directory.engines(NS)] == ["e1", "e2"]
    assert rds.pttl(f"{NS}/engines") > 25_000


@pytest.fixture
def network_io(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every connection attempt and every command redis-py sends, as it happens (counted, not
    timed: the machine's speed must not decide these tests)."""
    seen: list[str] = []
    real_connect = socket.socket.connect
    real_send = redis.connection.Connection.send_packed_command

    def connect(self, address):  # type: ignore[no-untyped-def]
        seen.append(f"connect {address}")
        return real_connect(self, address)

    def send(self, command, check_health=True):  # type: ignore[no-untyped-def]
        seen.append("command")
        return real_send(self, command, check_health)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", send)
    return seen


def test_circuit_breaker_and_recovery(redis_srv: RedisServer, rds: redis.Redis,
                                      network_io: list[str]) -> None:
    d = Directory(redis_srv.url, ttl_seconds=30.0, retry_seconds=0.5)
    sc = scope(tp=1)
    h = os.urandom(16)
    d.publish(sc, [(h, 0, 1)])
    assert d.available
    redis_srv.kill()
    network_io.clear()
    t0 = time.perf_counter()
    with pytest.raises(DirectoryUnavailable) as info:
        d.longest_prefix(sc, [h])
    # one try, no retries: bounded by the 0.25 s socket timeouts (5 s only catches a hang)
    assert network_io, "the first call after the kill tries the network (the hooks see it)"
    assert len([x for x in network_io if x.startswith("connect")]) <= 1, network_io
    assert time.perf_counter() - t0 < 5.0
    assert info.value.reason == "store_unavailable" and not d.available
    calls = [
        lambda: d.longest_prefix(sc, [h]), lambda: d.publish(sc, [(h, 0, 1)]),
        lambda: d.stored_bytes(sc, [h]), lambda: d.forget(sc, [h]),
        lambda: d.register_engine(entry("e", sc), 5), lambda: d.engines(NS),
        lambda: d.usage(NS),
    ]
    network_io.clear()
    for call in calls:
        with pytest.raises(DirectoryUnavailable):
            call()
    assert network_io == []  # the breaker: no network I/O at all while open
    redis_srv.start()
    with pytest.raises(DirectoryUnavailable):
        d.longest_prefix(sc, [h])  # still inside retry_seconds
    time.sleep(0.55)
    assert d.longest_prefix(sc, [h]) == 0  # back (and empty: no persistence)
    d.publish(sc, [(h, 0, 1)])
    assert d.longest_prefix(sc, [h]) == 1 and d.available
    d.close()


def test_no_network_in_init_and_bad_urls(network_io: list[str]) -> None:
    d = Directory(f"redis://127.0.0.1:{free_port()}", ttl_seconds=5)
    assert network_io == [] and d.available
    with pytest.raises(DirectoryUnavailable):
        d.longest_prefix(scope(), hashes(1))
    d.close()
    for url in ("resp://127.0.0.1:1", "http://x:1", "nohost"):
        with pytest.raises(StoreUrlError):
            Directory(url, ttl_seconds=5)
