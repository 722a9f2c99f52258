"""ChunkStore: opaque compressed chunk blobs in LMCache's storage tiers (CPU, disk, Redis).

Why LMCache's backends and not a hand-made cache: the CPU pool, its LRU eviction and the disk
tier are LMCache's (``LocalCPUBackend``, ``LocalDiskBackend``), and Redis is reached through
LMCache's ``RemoteBackend`` around our own connector plugin (:mod:`turbowire.store.redis_plugin`),
so deployments tune one storage layer. We drive the backends directly, on our own event-loop
thread, instead of through ``StorageManager``: we need per-put completion status, non-blocking
allocation and a bounded ``close()``, none of which ``StorageManager`` offers (measured
against LMCache's own tiers before this module was written).

Every object is a ``TensorMemoryObj`` of shape ``[1, 1, n, 1]`` uint8 (``KV_2LTD``; the only
layout every tier round-trips) holding a frame::

    "TWC1" | crc32 (u32) | blob length (u64) | name length (u16) | name | blob

``name`` is the object's ``StoreScope.chunk_key``; the CRC covers name and blob. A frame that
does not check out (a flipped or truncated Redis value, a short disk read, a file of another
key) is a miss, never wrong bytes, and is deleted from its tier.

Hazards handled here (LMCache 0.5.6):

* ``allocate()`` busy-loops forever on a full pool by default: we always pass
  ``busy_loop=False`` and drop the put (``put()`` returns False, counted as ``store_full``).
  ``LocalDiskBackend.get_blocking`` allocates with the default, so disk reads are ours
  (allocate, then the backend's ``read_file``).
* ``RemoteBackend.close()`` of the built-in Redis connectors deadlocks; our plugin has no job
  executor and :meth:`ChunkStore.close` bounds every step with a timeout.
* ``LocalDiskBackend`` keeps its index in memory only: after a restart its files are orphaned.
  We rescan the directory at start (the frame carries the key name), re-index what fits and
  delete what does not. One disk directory per ChunkStore: two live stores sharing one would
  evict each other's files behind each other's index.
* The CPU pool is also the staging buffer of disk and Redis I/O. With the CPU tier off
  (``local_cpu_bytes=0``) a pool of ``staging_bytes`` is kept for staging only.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

from turbowire.errors import TurboWireError, failure_reason
from turbowire.store.keys import CHUNK_HASH_BYTES, StoreKeyError, StoreScope
from turbowire.store.redis_plugin import (
    PLUGIN_NAME,
    StoreUrlError,
    TurboWireRedisConnector,
    check_store_url,
    engine_key,
    plugin_extra_config,
    redact_url,
)

logger = logging.getLogger(__name__)

FRAME = struct.Struct("<4sIQH")
MAGIC = b"TWC1"
PUT_TIMEOUT_SECONDS = 30.0  # a tier write that has not finished by then is reported failed
_CLOSE_STEP_SECONDS = 2.0
_DISK_NAME_MAX = 250  # file-name bytes; longer keys skip the disk tier
#: Longest object name (a ``StoreScope.chunk_key``, ~200 bytes at most); longer ones are refused.
MAX_NAME_BYTES = 512
_REDIS_VALUE_HEADER = 8  # redis_plugin.HEADER: the u64 length in front of every value
_LMCACHE_CHUNK = 256  # synthetic metadata: LMCache insists on whole chunks of tokens
_WINDING_DOWN: set[asyncio.Task[None]] = set()  # keeps the stop tasks of closed stores alive

Blob = bytes | bytearray | memoryview
OnDone = Callable[[bool, "str | None"], None]

__all__ = [
    "ChunkStore", "StoreConfigError", "StoreSettings", "StoreUnavailable", "StoreUrlError",
]


class StoreUnavailable(TurboWireError):
    """The chunk store (Redis) did not answer."""

    reason = "store_unavailable"


class StoreConfigError(TurboWireError, ValueError):
    """Settings the store cannot run with."""

    reason = "bad_params"


@dataclass(frozen=True)
class StoreSettings:
    """Where chunk blobs are kept. ``local_disk_bytes`` and ``staging_bytes`` are additions with
    defaults: LMCache's disk tier needs a capacity, and disk/Redis I/O needs a staging pool."""

    store_url: str | None  # redis://host:port[/db]; None = local tiers only
    local_cpu_bytes: int  # 0 = no local CPU tier
    local_disk: str | None  # directory for LMCache's disk tier, None = off
    ttl_seconds: float  # Redis TTL of every stored object (refreshed on access); 0 = none
    namespace: str
    max_inflight_puts: int = 16  # beyond this, put() drops and returns False
    socket_timeout_seconds: float = 0.5
    local_disk_bytes: int = 16 << 30  # capacity of the disk tier
    staging_bytes: int = 64 << 20  # staging pool when local_cpu_bytes == 0
    #: The largest blob this store is given (the engine's first chunk); a Redis value larger
    #: than its frame is never read whole (a counted miss). 0 = unbounded.
    max_object_bytes: int = 0

    @property
    def max_redis_value_bytes(self) -> int:
        """The largest Redis value a blob of ``max_object_bytes`` becomes (0 = unbounded)."""
        if not self.max_object_bytes:
            return 0
        return _REDIS_VALUE_HEADER + FRAME.size + MAX_NAME_BYTES + self.max_object_bytes

    def __post_init__(self) -> None:
        StoreScope(self.namespace, "x", "x", 1, 1, 1)  # validates the namespace
        if self.store_url is not None:
            check_store_url(self.store_url)
        for name in ("local_cpu_bytes", "local_disk_bytes", "staging_bytes", "max_object_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise StoreConfigError(f"{name} must be a non-negative integer (got {value!r})")
        if self.local_disk is not None and self.local_disk_bytes <= 0:
            raise StoreConfigError("local_disk_bytes must be positive with a disk tier")
        if not self.ttl_seconds >= 0 or math.isinf(self.ttl_seconds):
            raise StoreConfigError(f"ttl_seconds must be >= 0 and finite (got {self.ttl_seconds})")
        if self.max_inflight_puts < 1:
            raise StoreConfigError("max_inflight_puts must be at least 1")
        if not self.socket_timeout_seconds > 0:
            raise StoreConfigError("socket_timeout_seconds must be positive")


def _frame_size(name: bytes, n: int) -> int:
    return FRAME.size + len(name) + n


def _crc(name: bytes, blob: Blob) -> int:
    return zlib.crc32(blob, zlib.crc32(name))


@dataclass
class _PutJob:
    """One put's outstanding tier writes; on_done fires when the last one resolves."""

    name: str
    on_done: OnDone | None
    decisive: tuple[str, ...]  # the tiers whose result is the put's result
    pending: set[str] = field(default_factory=set)
    results: dict[str, tuple[bool, str | None]] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)


class ChunkStore:
    """Opaque blobs keyed by (scope, chunk hash, rank) across the configured tiers."""

    def __init__(self, settings: StoreSettings) -> None:
        self.settings = settings
        self._use_cpu = settings.local_cpu_bytes > 0
        self._use_disk = settings.local_disk is not None
        self._use_redis = settings.store_url is not None
        self._closed = False
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._jobs: set[int] = set()
        self._job_objs: dict[int, _PutJob] = {}
        self._inflight = threading.BoundedSemaphore(settings.max_inflight_puts)
        self._disk_waiters: dict[CacheEngineKey, list[_PutJob]] = {}
        self._remote_waiters: dict[CacheEngineKey, list[_PutJob]] = {}
        self._counters: dict[str, int] = {}
        self._active = 0  # put/get calls inside the backends (close() waits for them)
        self._callbacks = ThreadPoolExecutor(1, thread_name_prefix="turbowire-store-cb")
        self._cpu: LocalCPUBackend | None = None
        self._disk: LocalDiskBackend | None = None
        self._remote: RemoteBackend | None = None
        self._plugin: TurboWireRedisConnector | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        if not (self._use_cpu or self._use_disk or self._use_redis):
            logger.info("chunk store: no tier configured; puts are dropped, gets miss")
            return
        self._start_backends()

    # -- construction ----------------------------------------------------------------------

    def _config(self) -> LMCacheEngineConfig:
        s = self.settings
        pool = s.local_cpu_bytes if self._use_cpu else s.staging_bytes
        extra: dict[str, object] = {}
        kwargs: dict[str, object] = {}
        if self._use_redis:
            assert s.store_url is not None
            extra.update(plugin_extra_config(
                s.store_url, ttl_seconds=s.ttl_seconds,
                socket_timeout_seconds=s.socket_timeout_seconds,
                max_concurrency=s.max_inflight_puts + 8,
                max_value_bytes=s.max_redis_value_bytes,
            ))
            kwargs["remote_storage_plugins"] = [PLUGIN_NAME]
        if self._use_disk:
            assert s.local_disk is not None
            kwargs["local_disk"] = os.path.abspath(s.local_disk)
            kwargs["max_local_disk_size"] = s.local_disk_bytes / 1024**3
        return LMCacheEngineConfig.from_defaults(
            chunk_size=_LMCACHE_CHUNK, local_cpu=self._use_cpu,
            max_local_cpu_size=pool / 1024**3, remote_serde="naive", cache_policy="LRU",
            blocking_timeout_secs=max(1, math.ceil(6 * s.socket_timeout_seconds + 1)),
            extra_config=extra or None, **kwargs,
        )

    def _start_backends(self) -> None:
        config = self._config()
        # Synthetic metadata: the backends only need a chunk geometry with
        # full_chunk_size % chunk_size == 0; our objects carry their own shape.
        metadata = LMCacheMetadata(
            "turbowire", 1, 1, 0, 0, torch.uint8, (1, 2, _LMCACHE_CHUNK, 1, 2048), role="worker",
        )
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="turbowire-store-loop",
                                  daemon=True)
        thread.start()
        self._loop, self._thread = loop, thread
        try:
            # dst_device="cpu" explicitly: StorageManager would pick the GPU in an engine.
            self._cpu = LocalCPUBackend(config, metadata, dst_device="cpu")
            if self._use_disk:
                self._disk = LocalDiskBackend(config, loop, self._cpu, "cpu", None, metadata)
                self._rescan_disk()
            if self._use_redis:
                self._remote = RemoteBackend(config, metadata, loop, self._cpu, "cpu",
                                             plugin_name=PLUGIN_NAME)
                conn = self._remote.connection
                inner = conn.getWrappedConnector() if conn is not None else None
                if not isinstance(inner, TurboWireRedisConnector):
                    raise StoreConfigError(
                        f"LMCache did not load the {PLUGIN_NAME} connector plugin (got {conn!r})"
                    )
                self._plugin = inner
        except BaseException:
            self._stop_loop()
            raise
        logger.info(
            "chunk store: cpu=%s disk=%s redis=%s", self.settings.local_cpu_bytes or "off",
            self.settings.local_disk or "off",
            redact_url(self.settings.store_url) if self.settings.store_url else "off",
        )

    def _rescan_disk(self) -> None:
        """Re-index the files a previous process left (LMCache forgets them on restart)."""
        disk = self._disk
        assert disk is not None
        entries: list[tuple[float, str, CacheEngineKey, int]] = []
        for entry in os.scandir(disk.path):
            if not entry.name.endswith(".pt") or not entry.is_file():
                continue
            key = self._read_disk_header(entry.path)
            if key is None or disk._key_to_path(key) != entry.path:
                continue
            st = entry.stat()
            entries.append((st.st_mtime, entry.path, key, st.st_size))
        entries.sort()
        kept = dropped = 0
        for _, path, key, size in entries:
            phys = -(-size // 4096) * 4096
            with disk.disk_lock:
                fits = disk.current_cache_size + phys <= disk.max_cache_size
                if fits and key not in disk.dict:
                    disk.current_cache_size += phys
                    disk.usage += phys
                    disk.cache_policy.update_on_put(key)
            if not fits:
                dropped += 1
                _unlink_quietly(path)
                continue
            disk.insert_key(key, phys, torch.Size([1, 1, size, 1]), torch.uint8,
                            MemoryFormat.KV_2LTD)
            kept += 1
        if kept or dropped:
            logger.info("disk tier %s: re-indexed %d objects, removed %d over capacity",
                        disk.path, kept, dropped)

    @staticmethod
    def _read_disk_header(path: str) -> CacheEngineKey | None:
        try:
            with open(path, "rb") as f:
                head = f.read(FRAME.size)
                if len(head) < FRAME.size:
                    return None
                magic, _, _, name_len = FRAME.unpack(head)
                if magic != MAGIC:
                    return None
                name = f.read(name_len).decode("ascii")
            prefix, hex_hash, rank_s = name.rsplit("/", 2)
            tp = prefix.rsplit("/", 1)[-1]
            if not (rank_s.startswith("r") and tp.startswith("tp")):
                return None
            chunk_hash = bytes.fromhex(hex_hash)
            if len(chunk_hash) != CHUNK_HASH_BYTES:
                return None
            return CacheEngineKey(model_name=prefix, world_size=int(tp[2:]),
                                  worker_id=int(rank_s[1:]),
                                  chunk_hash=int.from_bytes(chunk_hash, "big"),
                                  dtype=torch.uint8, request_configs=None)
        except (OSError, ValueError, UnicodeDecodeError):
            return None

    # -- helpers ---------------------------------------------------------------------------

    def _keys(self, scope: StoreScope, chunk_hash: bytes, rank: int) -> tuple[str, CacheEngineKey]:
        """The Redis name and LMCache key; a scope of another namespace is refused."""
        if scope.namespace != self.settings.namespace:
            raise StoreKeyError(f"scope namespace {scope.namespace!r} is not this store's "
                                f"({self.settings.namespace!r})")
        name = scope.chunk_key(chunk_hash, rank)
        if len(name) > MAX_NAME_BYTES:
            raise StoreKeyError(f"object name of {len(name)} bytes (at most {MAX_NAME_BYTES})")
        return name, engine_key(scope, chunk_hash, rank)

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._counters[what] = self._counters.get(what, 0) + n

    def _enter(self) -> bool:
        """Register a call that touches the pool; False once closed."""
        with self._lock:
            if self._closed or self._cpu is None:
                return False
            self._active += 1
            return True

    def _leave(self) -> None:
        with self._lock:
            self._active -= 1
            self._idle.notify_all()

    def counters(self) -> dict[str, int]:
        """Event counts (drops by reason, corrupt objects, tier hits), for metrics and tests."""
        with self._lock:
            return dict(self._counters)

    def _stage(self, name: bytes, blob: Blob) -> MemoryObj | None:
        """A pool object holding the frame of ``blob``; None when the pool is full."""
        assert self._cpu is not None
        mv = memoryview(blob).cast("B")
        size = _frame_size(name, mv.nbytes)
        obj = self._cpu.allocate(torch.Size([1, 1, size, 1]), torch.uint8,
                                 MemoryFormat.KV_2LTD, eviction=True, busy_loop=False)
        if obj is None:
            return None
        view = obj.byte_array
        if view.format != "B":
            view = view.cast("B")
        FRAME.pack_into(view, 0, MAGIC, _crc(name, mv), mv.nbytes, len(name))
        view[FRAME.size:FRAME.size + len(name)] = name
        view[FRAME.size + len(name):] = mv
        return obj

    def _unstage(self, name: bytes, obj: MemoryObj) -> bytes | None:
        """The blob in ``obj`` if its frame is intact and belongs to ``name``, else None."""
        view = obj.byte_array
        if view.format != "B":
            view = view.cast("B")
        if view.nbytes < FRAME.size:
            return None
        magic, crc, n, name_len = FRAME.unpack_from(view, 0)
        start = FRAME.size + name_len
        if magic != MAGIC or view.nbytes != start + n or bytes(view[FRAME.size:start]) != name:
            return None
        blob = view[start:]
        if _crc(name, blob) != crc:
            return None
        return bytes(blob)

    # -- put -------------------------------------------------------------------------------

    def put(self, scope: StoreScope, chunk_hash: bytes, rank: int, blob: Blob,
            on_done: OnDone | None = None) -> bool:
        """Queue ``blob`` for every configured tier. Returns at once: False = dropped now
        (closed, nothing configured, too many puts in flight, pool full; ``on_done`` is not
        called), True = queued, and ``on_done(ok, reason)`` runs on a background thread when
        the writes finished. ``ok`` is the Redis write's result when Redis is configured (the
        local tiers are caches), else the local tiers'. Never raises for Redis being down."""
        name_s, key = self._keys(scope, chunk_hash, rank)
        if not self._enter():
            self._count("put_dropped_closed" if self._closed else "put_dropped_unconfigured")
            return False
        try:
            return self._put(key, name_s, blob, on_done)
        finally:
            self._leave()

    def _put(self, key: CacheEngineKey, name_s: str, blob: Blob, on_done: OnDone | None) -> bool:
        if not self._inflight.acquire(blocking=False):
            self._count("put_dropped_inflight")
            logger.debug("put %s dropped: %d puts in flight", name_s,
                         self.settings.max_inflight_puts)
            return False
        name = name_s.encode("ascii")
        try:
            obj = self._stage(name, blob)
        except BaseException:
            self._inflight.release()
            raise
        if obj is None:
            self._inflight.release()
            self._count("put_dropped_store_full")
            drops = self.counters()["put_dropped_store_full"]
            log = logger.warning if drops == 1 or drops % 1000 == 0 else logger.debug
            log("put %s dropped: no room for %d bytes in the CPU pool (%d such drops)", name_s,
                len(memoryview(blob).cast("B")), drops)
            return False
        tiers = [t for t, on in (("cpu", self._use_cpu), ("disk", self._use_disk),
                                 ("redis", self._use_redis)) if on]
        decisive = ("redis",) if self._use_redis else tuple(tiers)
        job = _PutJob(name_s, on_done, decisive, pending=set(tiers))
        with self._lock:
            self._job_objs[id(job)] = job
        try:
            if self._use_cpu:
                self._put_cpu(key, obj, job)
            if self._use_disk:
                self._put_disk(key, obj, job)
            if self._use_redis:
                self._put_redis(key, obj, job)
        except Exception as exc:  # noqa: BLE001 - a backend bug must not escape a put
            logger.exception("put %s failed in a tier", name_s)
            for tier in tiers:
                self._resolve(job, tier, False, failure_reason(exc))
        finally:
            obj.ref_count_down()  # our allocate() reference; the tiers hold their own
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._loop.call_later, PUT_TIMEOUT_SECONDS,
                                            self._expire, job)
        except RuntimeError:  # loop already closed (close() racing)
            self._expire(job)
        return True

    def _put_cpu(self, key: CacheEngineKey, obj: MemoryObj, job: _PutJob) -> None:
        assert self._cpu is not None
        self._cpu.submit_put_task(key, obj)  # synchronous; a present key is kept as is
        self._resolve(job, "cpu", True, None)

    def _put_disk(self, key: CacheEngineKey, obj: MemoryObj, job: _PutJob) -> None:
        disk = self._disk
        assert disk is not None
        if len(os.path.basename(disk._key_to_path(key)).encode()) > _DISK_NAME_MAX:
            self._resolve(job, "disk", False, "bad_params")
            return
        with self._lock:
            self._disk_waiters.setdefault(key, []).append(job)
        disk.submit_put_task(key, obj, on_complete_callback=self._disk_written)
        # submit_put_task returns nothing: a key neither being written nor indexed was refused
        # (disk full of pinned objects, or larger than the tier)
        if not disk.exists_in_put_tasks(key):
            ok = disk.contains(key)
            self._finish_disk(key, ok, None if ok else "store_full", only=job)

    def _disk_written(self, key: CacheEngineKey) -> None:
        self._finish_disk(key, True, None)

    def _finish_disk(self, key: CacheEngineKey, ok: bool, reason: str | None,
                     only: _PutJob | None = None) -> None:
        with self._lock:
            waiters = self._disk_waiters.get(key, [])
            if only is not None:
                done = [j for j in waiters if j is only]
                rest = [j for j in waiters if j is not only]
            else:
                done, rest = waiters, []
            if rest:
                self._disk_waiters[key] = rest
            else:
                self._disk_waiters.pop(key, None)
        for j in done:
            self._resolve(j, "disk", ok, reason)

    def _put_redis(self, key: CacheEngineKey, obj: MemoryObj, job: _PutJob) -> None:
        remote, plugin = self._remote, self._plugin
        assert remote is not None and plugin is not None
        if not plugin.available:  # breaker open: fail now, no LMCache error log per put
            self._resolve(job, "redis", False, StoreUnavailable.reason)
            return
        with self._lock:
            waiting = self._remote_waiters.get(key)
            if waiting is not None:  # the same object is being written: share its result
                waiting.append(job)
                return
            self._remote_waiters[key] = [job]
        fut = remote.submit_put_task(key, obj)
        fut.add_done_callback(lambda f: self._redis_written(key, f))

    def _redis_written(self, key: CacheEngineKey, fut: Future) -> None:
        exc = None if fut.cancelled() else fut.exception()
        ok = not fut.cancelled() and exc is None
        reason = None if ok else (failure_reason(exc) if exc else "store_unavailable")
        if reason == "internal":
            reason = StoreUnavailable.reason
        with self._lock:
            waiters = self._remote_waiters.pop(key, [])
        for j in waiters:
            self._resolve(j, "redis", ok, reason)

    def _expire(self, job: _PutJob) -> None:
        with self._lock:
            pending = list(job.pending)
        for tier in pending:
            self._resolve(job, tier, False, "store_timeout")

    def _resolve(self, job: _PutJob, tier: str, ok: bool, reason: str | None) -> None:
        with self._lock:
            if tier not in job.pending:
                return
            job.pending.discard(tier)
            job.results[tier] = (ok, reason)
            if job.pending:
                return
            self._job_objs.pop(id(job), None)
            final_ok = all(job.results[t][0] for t in job.decisive)
            final_reason = None
            if not final_ok:
                final_reason = next(job.results[t][1] for t in job.decisive
                                    if not job.results[t][0]) or "internal"
            for t, (t_ok, t_reason) in job.results.items():
                key = f"put_{t}_ok" if t_ok else f"put_{t}_failed_{t_reason}"
                self._counters[key] = self._counters.get(key, 0) + 1
            self._jobs.add(id(job))  # callback still to run
        self._inflight.release()
        if not final_ok:
            logger.debug("put %s failed: %s", job.name, job.results)
        try:
            self._callbacks.submit(self._run_callback, job, final_ok, final_reason)
        except RuntimeError:  # executor shut down by close()
            self._run_callback(job, final_ok, final_reason)

    def _run_callback(self, job: _PutJob, ok: bool, reason: str | None) -> None:
        try:
            if job.on_done is not None:
                job.on_done(ok, reason)
        except Exception:  # noqa: BLE001 - a caller's callback must not kill our thread
            logger.exception("on_done callback of put %s raised", job.name)
        finally:
            with self._lock:
                self._jobs.discard(id(job))
                self._idle.notify_all()

    # -- get -------------------------------------------------------------------------------

    def get(self, scope: StoreScope, chunk_hash: bytes, rank: int) -> bytes | None:
        """Exactly the bytes put, or None (miss, corrupt object, Redis down). Falls through
        CPU -> disk -> Redis; a disk or Redis hit is written back into the CPU tier."""
        name_s, key = self._keys(scope, chunk_hash, rank)
        if not self._enter():
            return None
        name = name_s.encode("ascii")
        try:
            if self._use_cpu:
                data = self._get_cpu(key, name)
                if data is not None:
                    self._count("get_hit_cpu")
                    return data
            if self._use_disk:
                data = self._get_disk(key, name)
                if data is not None:
                    self._count("get_hit_disk")
                    return data
            if self._use_redis:
                data = self._get_redis(key, name)
                if data is not None:
                    self._count("get_hit_redis")
                    return data
        except Exception:  # noqa: BLE001 - a read never fails the caller: it misses
            logger.exception("get %s failed", name_s)
        finally:
            self._leave()
        self._count("get_miss")
        return None

    def _get_cpu(self, key: CacheEngineKey, name: bytes) -> bytes | None:
        assert self._cpu is not None
        obj = self._cpu.get_blocking(key)
        if obj is None:
            return None
        try:
            data = self._unstage(name, obj)
        finally:
            obj.ref_count_down()
        if data is None:
            self._corrupt("cpu", name)
            self._cpu.remove(key)
        return data

    def _get_disk(self, key: CacheEngineKey, name: bytes) -> bytes | None:
        disk, cpu = self._disk, self._cpu
        assert disk is not None and cpu is not None
        with disk.disk_lock:
            meta = disk.dict.get(key)
            if meta is None:
                return None
            path, shape, dtype, fmt = meta.path, meta.shape, meta.dtype, meta.fmt
        obj = cpu.allocate(shape, dtype, fmt, eviction=True, busy_loop=False)
        if obj is None:
            self._count("get_disk_no_staging")
            return None
        try:
            disk.read_file(key, obj.byte_array, path)  # a vanished file drops the index entry
            if not disk.contains(key):
                return None
            data = self._unstage(name, obj)
            if data is None:
                self._corrupt("disk", name)
                disk.remove(key)
            elif self._use_cpu:
                cpu.submit_put_task(key, obj)
            return data
        finally:
            obj.ref_count_down()

    def _get_redis(self, key: CacheEngineKey, name: bytes) -> bytes | None:
        remote, plugin, cpu = self._remote, self._plugin, self._cpu
        assert remote is not None and plugin is not None and cpu is not None
        if not plugin.available:
            self._count("get_redis_unavailable")
            return None
        obj = remote.get_blocking(key)
        if obj is None:
            return None
        try:
            data = self._unstage(name, obj)
            if data is None:
                self._corrupt("redis", name)
                remote.remove(key)
            elif self._use_cpu:
                cpu.submit_put_task(key, obj)
            return data
        finally:
            obj.ref_count_down()

    def _corrupt(self, tier: str, name: bytes) -> None:
        self._count(f"corrupt_{tier}")
        logger.warning("%s object %s failed its integrity check: dropped", tier, name.decode())

    def discard(self, scope: StoreScope, chunk_hash: bytes, rank: int) -> None:
        """Remove an object from every tier: a reader found it intact in its frame but not the
        chunk it must be (its blob or layer checks failed), so a later save can replace it
        (puts never overwrite)."""
        _, key = self._keys(scope, chunk_hash, rank)
        if not self._enter():
            return
        try:
            if self._cpu is not None and self._use_cpu:
                self._cpu.remove(key)
            if self._disk is not None:
                self._disk.remove(key)
            if self._remote is not None:
                self._remote.remove(key)
            self._count("discarded")
        except Exception:  # noqa: BLE001 - best effort: the entry expires anyway
            logger.exception("discarding %s failed", scope.chunk_key(chunk_hash, rank))
        finally:
            self._leave()

    def contains_local(self, scope: StoreScope, chunk_hash: bytes, rank: int) -> bool:
        """Whether the CPU or disk tier holds the object (no network I/O)."""
        _, key = self._keys(scope, chunk_hash, rank)
        if not self._enter():
            return False
        try:
            if self._use_cpu and self._cpu is not None and self._cpu.contains(key):
                return True
            return self._disk is not None and self._disk.contains(key)
        finally:
            self._leave()

    # -- lifecycle -------------------------------------------------------------------------

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued put finished and its on_done ran; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._job_objs or self._jobs:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(min(left, 0.05))
        return True

    def close(self) -> None:
        """Shut down in bounded time (a few seconds at most), even with Redis dead or puts in
        flight: unfinished puts report ``store_closed``; the CPU pool is freed only when no
        I/O can still touch it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._cpu is None:
            self._callbacks.shutdown(wait=False)
            return
        self.flush(timeout=1.0)
        with self._lock:
            stuck = list(self._job_objs.values())
        for job in stuck:
            for tier in list(job.pending):
                self._resolve(job, tier, False, "store_closed")
        safe = True
        loop = self._loop
        assert loop is not None
        if self._plugin is not None:
            fut = asyncio.run_coroutine_threadsafe(self._plugin.close(), loop)
            try:
                fut.result(timeout=_CLOSE_STEP_SECONDS + 0.5)
            except Exception as exc:  # noqa: BLE001
                fut.cancel()
                logger.warning("closing the Redis connector: %s", exc)
        if self._disk is not None:  # waits for queued disk writes (needs the loop's workers)
            safe = _bounded(self._disk.close, "the disk tier") and safe
        # What is still on the loop (Redis commands to a dead or paused server) is cancelled.
        # redis-py may hold a cancelled command until its socket timeout; such a command no
        # longer touches the pool (the closed connector checks first), and the loop stops by
        # itself once they are done instead of close() waiting for them.
        fut = asyncio.run_coroutine_threadsafe(_cancel_tasks(0.5), loop)
        try:
            drained = bool(fut.result(timeout=_CLOSE_STEP_SECONDS))
        except Exception as exc:  # noqa: BLE001
            fut.cancel()
            drained = False
            logger.warning("cancelling the store's pending I/O: %s", exc)
        deadline = time.monotonic() + _CLOSE_STEP_SECONDS
        with self._lock:
            while self._active and time.monotonic() < deadline:
                self._idle.wait(0.05)
            if self._active:
                safe = False  # a get or put is still copying through the pool
        if drained:
            self._stop_loop()
        else:
            logger.debug("chunk store loop winds down after its last Redis command")
        if safe:
            _bounded(self._cpu.close, "the CPU tier")
        else:
            logger.warning("chunk store closed with I/O outstanding: CPU pool left allocated")
        self._callbacks.shutdown(wait=False)
        logger.info("chunk store closed")

    def _stop_loop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            loop.call_soon_threadsafe(loop.stop)
        except RuntimeError:
            pass
        thread.join(timeout=_CLOSE_STEP_SECONDS)
        if not thread.is_alive():
            loop.close()

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _cancel_tasks(timeout: float) -> bool:
    """Cancel every other task of the running loop; True when all of them finished."""
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for t in tasks:
        t.cancel()
    if not tasks:
        return True
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    if pending:
        loop = asyncio.get_running_loop()

        async def stop_when_done() -> None:
            await asyncio.wait(pending, timeout=PUT_TIMEOUT_SECONDS)
            loop.stop()

        _WINDING_DOWN.add(loop.create_task(stop_when_done()))
    return not pending


def _bounded(fn: Callable[[], object], what: str) -> bool:
    """Run a blocking shutdown step in a daemon thread; False if it did not finish in time."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=run, name="turbowire-store-close", daemon=True)
    t.start()
    t.join(_CLOSE_STEP_SECONDS)
    if t.is_alive():
        logger.warning("closing %s did not finish in %.0fs; left running", what,
                       _CLOSE_STEP_SECONDS)
        return False
    if errors:
        logger.warning("closing %s: %s", what, errors[0])
    return True


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
