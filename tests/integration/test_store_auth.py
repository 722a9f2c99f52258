"""The store's Redis with a password (issue 33, M6), against a real ``redis-server --requirepass``.

Why real: whether a client authenticates, and what it says when it cannot, depends on how Redis
and redis-py answer (NOAUTH per command, WRONGPASS at connect), which a fake would only assume.
The password reaches every client through the environment (``TURBOWIRE_STORE_PASSWORD`` or
``TURBOWIRE_STORE_PASSWORD_FILE``), never through a URL; without it the error says what to set,
once, and never carries the password.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from support.redis_server import RedisServer

from turbowire.store.directory import (
    STORE_PASSWORD_ENV,
    STORE_PASSWORD_FILE_ENV,
    Directory,
    DirectoryUnavailable,
)
from turbowire.store.keys import StoreScope
from turbowire.store.tiers import ChunkStore, StoreSettings

pytestmark = pytest.mark.integration

PASSWORD = "s3cret-store-pw \"with\" quotes\\"
NS = "twauth"


def scope() -> StoreScope:
    return StoreScope(NS, "tiny-model", "tq3", 1, 256, 1)


@pytest.fixture(scope="module")
def locked() -> Iterator[RedisServer]:
    with RedisServer(password=PASSWORD) as server:
        yield server


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (STORE_PASSWORD_ENV, STORE_PASSWORD_FILE_ENV, "TURBOWIRE_STORE_USERNAME"):
        monkeypatch.delenv(name, raising=False)


def test_the_server_really_requires_the_password(locked: RedisServer) -> None:
    client = redis.Redis.from_url(locked.url)
    with pytest.raises(redis.exceptions.AuthenticationError):
        client.ping()
    client.close()


@pytest.mark.parametrize("how", ["env", "file"])
def test_directory_authenticates_from_the_environment(
    locked: RedisServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, how: str
) -> None:
    if how == "env":
        monkeypatch.setenv(STORE_PASSWORD_ENV, PASSWORD)
    else:
        path = tmp_path / "password"
        path.write_text(PASSWORD + "\n")  # a Secret's trailing newline is ignored
        monkeypatch.setenv(STORE_PASSWORD_FILE_ENV, str(path))
        monkeypatch.setenv(STORE_PASSWORD_ENV, "not-this-one")  # the file wins
    d = Directory(locked.url, ttl_seconds=30.0)
    try:
        chunk = os.urandom(16)
        d.publish(scope(), [(chunk, 0, 123)])
        assert d.longest_prefix(scope(), [chunk]) == 1
        assert d.stored_bytes(scope(), [chunk]) == [123]
    finally:
        d.close()


@pytest.mark.parametrize("password", [None, "wrong-password"])
def test_directory_without_the_password_says_what_to_set_once(
    locked: RedisServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    password: str | None,
) -> None:
    if password is not None:
        monkeypatch.setenv(STORE_PASSWORD_ENV, password)
    d = Directory(locked.url, ttl_seconds=30.0, retry_seconds=0.0)  # no breaker between calls
    caplog.set_level(logging.DEBUG, logger="turbowire")
    try:
        for _ in range(3):
            with pytest.raises(DirectoryUnavailable) as info:
                d.longest_prefix(scope(), [os.urandom(16)])
            assert STORE_PASSWORD_ENV in str(info.value)
            assert STORE_PASSWORD_FILE_ENV in str(info.value)
    finally:
        d.close()
    hints = [r for r in caplog.records if STORE_PASSWORD_ENV in r.getMessage()]
    assert len(hints) == 1 and hints[0].levelno == logging.ERROR, caplog.text
    assert PASSWORD not in caplog.text
    if password is not None:
        assert password not in caplog.text


@pytest.fixture
def stores() -> Iterator[list[ChunkStore]]:
    made: list[ChunkStore] = []
    yield made
    for store in made:
        store.close()


def redis_store(url: str, stores: list[ChunkStore]) -> ChunkStore:
    """A ChunkStore with only the Redis tier: every put and get goes through the plugin."""
    store = ChunkStore(StoreSettings(store_url=url, local_cpu_bytes=0, local_disk=None,
                                     ttl_seconds=60.0, namespace=NS, staging_bytes=4 << 20))
    stores.append(store)
    return store


def test_redis_plugin_authenticates_from_a_password_file(
    locked: RedisServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    stores: list[ChunkStore],
) -> None:
    path = tmp_path / "password"
    path.write_text(PASSWORD)
    monkeypatch.setenv(STORE_PASSWORD_FILE_ENV, str(path))
    store = redis_store(locked.url, stores)
    chunk, blob = os.urandom(16), os.urandom(50_000)
    assert store.put(scope(), chunk, 0, blob)
    assert store.flush(20.0)
    assert store.get(scope(), chunk, 0) == blob
    admin = redis.Redis.from_url(locked.url, password=PASSWORD)
    assert admin.exists(scope().chunk_key(chunk, 0))
    admin.close()


def test_redis_plugin_without_the_password_says_what_to_set_once(
    locked: RedisServer, caplog: pytest.LogCaptureFixture, stores: list[ChunkStore]
) -> None:
    caplog.set_level(logging.DEBUG, logger="turbowire")
    store = redis_store(locked.url, stores)
    for _ in range(3):
        chunk = os.urandom(16)
        store.put(scope(), chunk, 0, os.urandom(10_000))
        store.flush(20.0)
        assert store.get(scope(), chunk, 0) is None
    hints = [r for r in caplog.records
             if STORE_PASSWORD_ENV in r.getMessage() and r.levelno >= logging.WARNING]
    assert len(hints) == 1, caplog.text
    assert STORE_PASSWORD_FILE_ENV in hints[0].getMessage()
    assert PASSWORD not in caplog.text


def test_the_charts_redis_conf_makes_redis_require_the_secrets_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chart's init container script (run by a POSIX sh, as in the Redis image) turns the
    Secret's file into a redis.conf that a real redis-server enforces, with quotes and
    backslashes in the password and the Secret's trailing newline stripped."""
    import helm_python
    import yaml
    from support.redis_server import free_port, redis_binary

    chart = helm_python.Chart.load(str(Path(__file__).resolve().parents[2] / "helm/turbowire"))
    out = chart.render({"turbowire": {"transport": "store"}, "redis": {"enabled": True}},
                       name="tw", namespace="llm")
    (deployment,) = [d for d in yaml.safe_load_all(out["turbowire/templates/redis.yaml"])
                     if d and d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    conf_path = pod["containers"][0]["args"][0]
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    script = init["command"][-1]
    for name, mount in mounts.items():
        (tmp_path / name).mkdir()
        script = script.replace(mount, str(tmp_path / name))
        conf_path = conf_path.replace(mount, str(tmp_path / name))
    (tmp_path / "auth" / "password").write_text(PASSWORD + "\n")
    subprocess.run(["sh", "-ec", script], check=True, timeout=30)
    assert PASSWORD not in script
    port = free_port()
    proc = subprocess.Popen([redis_binary(), conf_path, "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, cwd=tmp_path)
    try:
        url = f"redis://127.0.0.1:{port}"
        monkeypatch.setenv(STORE_PASSWORD_ENV, PASSWORD)
        d = Directory(url, ttl_seconds=30.0, retry_seconds=0.0)
        deadline = time.monotonic() + 10
        while True:
            try:
                assert d.longest_prefix(scope(), [os.urandom(16)]) == 0
                break
            except DirectoryUnavailable:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        d.close()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis.from_url(url).ping()
    finally:
        proc.kill()
        proc.wait()
