"""Our LMCache ``RemoteConnector`` for Redis: one key per object, a length header, a TTL.

Why not LMCache's own: ``redis://`` (``RedisConnector``) writes two keys per object without a
TTL and its ``close()`` deadlocks (``AsyncPQExecutor.shutdown(wait=True)`` run on its own loop);
``resp://`` corrupts every object that is not exactly one full chunk long (both measured
against LMCache before this plugin was written). LMCache loads this class through its plugin
hook (``remote_storage_plugins`` + ``extra_config["remote_storage_plugin.<name>.*"]``, see
:func:`plugin_extra_config`), builds a ``RemoteBackend`` around it and calls it on its loop.

Value layout: ``u64 big-endian payload length || payload``. A value whose header disagrees with
its length is a truncated or corrupt object: it is deleted and read as a miss. The Redis key is
the :meth:`StoreScope.chunk_key` of the object, recovered from the ``CacheEngineKey``
(:func:`engine_key` / :func:`redis_key`), so every key starts with ``<namespace>/``.

Never overwritten: a put is ``SET NX`` (a value already stored under the key is kept: a chunk is
a function of its key, and a writer must not replace bytes other engines already read). Reads
are bounded: with ``max_value_bytes`` set (the largest object this store writes) a get reads at
most that many bytes plus one (GETRANGE, then PEXPIRE for the TTL), so a value planted by
someone who can write to Redis costs no more memory than a real chunk: an oversized value is a
counted miss, deleted, and never allocated from LMCache's pool.

The password comes from the environment (:func:`turbowire.store.directory.store_credentials`),
never from ``extra_config`` (LMCache and vLLM log it); an AUTH refusal is logged once, naming
the variables to set.

Bounded: a semaphore caps concurrent commands (LMCache has no backpressure: without it puts fail
with "Too many connections"); short socket timeouts plus a circuit breaker keep a dead Redis from
slowing reads down (after a connection failure, commands fail at once for ``breaker_seconds``).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from typing import Any

import redis.asyncio as aioredis
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from turbowire.errors import TurboWireError
from turbowire.store.directory import (
    StoreUrlError,
    auth_failure_message,
    check_store_url,
    is_auth_error,
    redact_url,
    store_credentials,
)
from turbowire.store.keys import CHUNK_HASH_BYTES, StoreScope

logger = logging.getLogger(__name__)

__all__ = [
    "PLUGIN_NAME", "RemoteStoreUnavailable", "StoreUrlError", "TurboWireRedisConnector",
    "check_store_url", "engine_key", "plugin_extra_config", "redact_url", "redis_key",
]

PLUGIN_NAME = "turbowire_redis"
PLUGIN_CLASS = "TurboWireRedisConnector"
HEADER = struct.Struct(">Q")

# extra_config keys read by the plugin (the plugin is built by LMCache from the config alone)
CFG_URL = "turbowire.redis.url"
CFG_TTL = "turbowire.redis.ttl_seconds"
CFG_TIMEOUT = "turbowire.redis.socket_timeout_seconds"
CFG_CONCURRENCY = "turbowire.redis.max_concurrency"
CFG_BREAKER = "turbowire.redis.breaker_seconds"
CFG_MAX_VALUE = "turbowire.redis.max_value_bytes"

class RemoteStoreUnavailable(TurboWireError):
    """Redis did not answer (down, timed out, or the circuit breaker is open)."""

    reason = "store_unavailable"


def engine_key(scope: StoreScope, chunk_hash: bytes, rank: int) -> CacheEngineKey:
    """The LMCache key of rank ``rank``'s bytes of a chunk (model_name carries the scope prefix,
    world_size the TP degree, worker_id the rank; the prefix holds no ``@``)."""
    scope.chunk_key(chunk_hash, rank)  # validates the hash length and the rank
    return CacheEngineKey(
        model_name=scope.prefix, world_size=scope.tp_size, worker_id=rank,
        chunk_hash=int.from_bytes(chunk_hash, "big"), dtype=torch.uint8, request_configs=None,
    )


def redis_key(key: CacheEngineKey) -> str:
    """The Redis key of an LMCache key built by :func:`engine_key`: ``StoreScope.chunk_key``."""
    return f"{key.model_name}/{key.chunk_hash:0{2 * CHUNK_HASH_BYTES}x}/r{key.worker_id}"


def plugin_extra_config(url: str, *, ttl_seconds: float, socket_timeout_seconds: float,
                        max_concurrency: int, breaker_seconds: float = 1.0,
                        max_value_bytes: int = 0) -> dict[str, Any]:
    """The ``extra_config`` entries that make LMCache load this connector
    (``max_value_bytes``: the largest Redis value a get reads, 0 = unbounded)."""
    return {
        CFG_MAX_VALUE: int(max_value_bytes),
        f"remote_storage_plugin.{PLUGIN_NAME}.module_path": __name__,
        f"remote_storage_plugin.{PLUGIN_NAME}.class_name": PLUGIN_CLASS,
        CFG_URL: check_store_url(url),
        CFG_TTL: float(ttl_seconds),
        CFG_TIMEOUT: float(socket_timeout_seconds),
        CFG_CONCURRENCY: int(max_concurrency),
        CFG_BREAKER: float(breaker_seconds),
    }


def frame_value(payload: memoryview | bytes) -> bytes:
    """``u64 length || payload`` (one copy: redis-py needs one buffer anyway)."""
    return b"".join((HEADER.pack(len(payload)), payload))


def unframe_value(value: bytes) -> memoryview | None:
    """The payload of a stored value, or None when the header disagrees with the length."""
    if len(value) < HEADER.size:
        return None
    (length,) = HEADER.unpack_from(value, 0)
    if length != len(value) - HEADER.size:
        return None
    return memoryview(value)[HEADER.size:]


class TurboWireRedisConnector(RemoteConnector):
    """LMCache ``RemoteConnector`` storing opaque uint8 objects in Redis (see module doc)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: LocalCPUBackend,
                 config: LMCacheEngineConfig) -> None:
        super().__init__(config, local_cpu_backend.metadata)
        extra = config.extra_config or {}
        self.url = check_store_url(str(extra[CFG_URL]))
        self.ttl_ms = max(0, int(float(extra.get(CFG_TTL, 0.0)) * 1000))
        self.timeout = float(extra.get(CFG_TIMEOUT, 0.5))
        self.breaker_seconds = float(extra.get(CFG_BREAKER, 1.0))
        concurrency = max(1, int(extra.get(CFG_CONCURRENCY, 16)))
        self.max_value_bytes = max(0, int(extra.get(CFG_MAX_VALUE, 0)))
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self._sem = asyncio.Semaphore(concurrency)
        self._open_until = 0.0  # monotonic time until which the breaker fails commands at once
        self._closed = False
        # One retry on a fresh connection: after a Redis restart every pooled connection is
        # dead, and the first command on each would otherwise fail although Redis is back.
        self.client = aioredis.Redis.from_url(
            self.url, socket_timeout=self.timeout, socket_connect_timeout=self.timeout,
            retry=Retry(NoBackoff(), 1), max_connections=concurrency + 2,
            **store_credentials(self.url),
        )
        self._auth_logged = False
        self.corrupt_count = 0
        self.oversize_count = 0
        self.kept_existing_count = 0  # puts that found the key already stored (SET NX)
        logger.info("turbowire Redis connector for %s (ttl %d ms)", redact_url(self.url),
                    self.ttl_ms)

    # -- plumbing ------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """False while the circuit breaker is open (a recent connection failure)."""
        return not self._closed and time.monotonic() >= self._open_until

    def _trip(self, exc: BaseException) -> None:
        was_open = time.monotonic() < self._open_until
        self._open_until = time.monotonic() + self.breaker_seconds
        if is_auth_error(exc):  # wrong or missing password: say what to set, once
            if not self._auth_logged:
                self._auth_logged = True
                logger.error("%s", auth_failure_message(self.url, exc))
            return
        if not was_open:
            logger.warning("Redis %s unavailable (%s: %s); failing fast for %.1fs",
                           redact_url(self.url), type(exc).__name__, exc, self.breaker_seconds)

    async def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """One command under the semaphore, the breaker and a hard deadline."""
        if not self.available:
            raise RemoteStoreUnavailable("Redis circuit breaker is open")
        try:
            async with self._sem:
                # two connect/read timeouts plus the retry: never hang on a dead peer
                return await asyncio.wait_for(fn(*args, **kwargs), timeout=4 * self.timeout + 1)
        except (RedisConnectionError, RedisTimeoutError, asyncio.TimeoutError, OSError) as exc:
            self._trip(exc)
            if is_auth_error(exc):  # the hint is logged once by _trip; LMCache logs this one
                raise RemoteStoreUnavailable("Redis refused authentication") from exc
            raise RemoteStoreUnavailable(f"Redis unavailable: {type(exc).__name__}") from exc
        except RedisError as exc:
            raise RemoteStoreUnavailable(f"Redis error: {exc}") from exc

    # -- RemoteConnector -----------------------------------------------------------------

    async def exists(self, key: CacheEngineKey) -> bool:
        try:
            return bool(await self._run(self.client.exists, redis_key(key)))
        except RemoteStoreUnavailable:
            return False

    def exists_sync(self, key: CacheEngineKey) -> bool:
        fut = asyncio.run_coroutine_threadsafe(self.exists(key), self.loop)
        try:
            return bool(fut.result(timeout=4 * self.timeout + 2))
        except Exception:  # noqa: BLE001 - a lookup never fails the caller
            fut.cancel()
            return False

    async def _get_bounded(self, name: str) -> bytes | None:
        """At most ``max_value_bytes + 1`` bytes of the value (one pipelined trip, the TTL
        refreshed with it); None when the key is missing (an empty value is b"": corrupt)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.getrange(name, 0, self.max_value_bytes)
        if self.ttl_ms:
            pipe.pexpire(name, self.ttl_ms)  # 1 when the key exists
        else:
            pipe.exists(name)
        value, exists = await pipe.execute()
        if not exists:
            return None
        return bytes(value or b"")

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        """The object, or None on a miss, a corrupt or oversized value, a full pool or Redis
        down; a hit refreshes the TTL (GETEX, or PEXPIRE with a bounded read)."""
        name = redis_key(key)
        try:
            if self.max_value_bytes:
                value = await self._run(self._get_bounded, name)
            elif self.ttl_ms:
                value = await self._run(self.client.getex, name, px=self.ttl_ms)
            else:
                value = await self._run(self.client.get, name)
        except RemoteStoreUnavailable as exc:
            logger.debug("get %s: %s", name, exc)
            return None
        if value is None or self._closed:  # closed: the pool may be gone, do not allocate
            return None
        if self.max_value_bytes and len(value) > self.max_value_bytes:
            self.oversize_count += 1
            logger.warning("Redis object %s is larger than any chunk this store writes (over %d "
                           "bytes): dropped, read as a miss", name, self.max_value_bytes)
            await self._delete_quietly(name)
            return None
        payload = unframe_value(value)
        if payload is None or len(payload) == 0:
            self.corrupt_count += 1
            logger.warning("Redis object %s is truncated or corrupt (%d bytes): dropped",
                           name, len(value))
            await self._delete_quietly(name)
            return None
        obj = self.local_cpu_backend.allocate(
            torch.Size([1, 1, len(payload), 1]), torch.uint8, MemoryFormat.KV_2LTD,
            eviction=True, busy_loop=False,
        )
        if obj is None or obj.tensor is None:
            if obj is not None:
                obj.ref_count_down()
            logger.warning("no staging memory for a %d-byte Redis object: read as a miss",
                           len(payload))
            return None
        view = obj.byte_array
        if view.format != "B":
            view = view.cast("B")
        view[:] = payload
        return obj

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        """SET NX with the TTL (an existing value is kept); raises
        :class:`RemoteStoreUnavailable` on failure (LMCache's wrapper drops the object's
        reference either way)."""
        if self._closed:  # the pool may be freed after close(): never read it then
            raise RemoteStoreUnavailable("the connector is closed")
        value = frame_value(memory_obj.byte_array)
        name = redis_key(key)
        if self.ttl_ms:
            written = await self._run(self.client.set, name, value, px=self.ttl_ms, nx=True)
        else:
            written = await self._run(self.client.set, name, value, nx=True)
        if not written:  # stored already: kept as it is, never overwritten
            self.kept_existing_count += 1
            logger.debug("put %s: already stored, kept", name)

    async def _delete_quietly(self, name: str) -> None:
        try:
            await self._run(self.client.delete, name)
        except RemoteStoreUnavailable:
            pass

    async def remove(self, key: CacheEngineKey) -> bool:
        try:
            return bool(await self._run(self.client.delete, redis_key(key)))
        except RemoteStoreUnavailable:
            return False

    def remove_sync(self, key: CacheEngineKey) -> bool:
        fut = asyncio.run_coroutine_threadsafe(self.remove(key), self.loop)
        try:
            return bool(fut.result(timeout=4 * self.timeout + 2))
        except Exception:  # noqa: BLE001
            fut.cancel()
            return False

    async def list(self) -> list[str]:
        """Not used by turbowire (a directory lists chunks); kept empty on purpose."""
        return []

    async def close(self) -> None:
        """Closes the connection pool; never waits on queued work (no executor here)."""
        self._closed = True
        try:
            await asyncio.wait_for(self.client.aclose(), timeout=2.0)
        except Exception as exc:  # noqa: BLE001 - shutdown is best effort
            logger.debug("closing the Redis client: %s", exc)

    def support_batched_async_contains(self) -> bool:
        return False

    def support_batched_get_non_blocking(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<TurboWireRedisConnector {redact_url(self.url)}>"
