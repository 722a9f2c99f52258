"""The chunk directory and the engine registry, in Redis (redis-py, sync).

Why separate from the blobs: the proxy and the schedulers ask "how many leading chunks of this
prompt are stored, on every rank?" many times per second; answering from a small hash per chunk
costs one pipelined round trip instead of one existence probe per rank and blob, and it may live
on another Redis than the bytes.

Keys (every one starts with ``<namespace>/``; names hold no ``/``, so shapes never collide):

* ``{scope.prefix}/{hash hex}``: a hash ``{"r<rank>": nbytes}`` (7 segments), TTL refreshed by
  :meth:`Directory.publish` and by :meth:`Directory.touch` (an engine that really loaded the
  chunk), never by a lookup: asking costs the owner nothing and keeps nothing alive (a proxy
  probing prompts must not extend another tenant's entries);
* ``{namespace}/engines``: the engine registry, one hash ``{engine_id: JSON}`` (2 segments); each
  entry carries its own ``expires_at`` (unix time) and is ignored past it, the hash expires with
  its newest entry. One HGETALL reads it: no SCAN over the keyspace (chunks included);
* the blobs of :mod:`turbowire.store.tiers` are ``{scope.prefix}/{hash hex}/r<rank>`` (8).

Credentials come from the environment (:func:`store_credentials`: ``TURBOWIRE_STORE_PASSWORD_FILE``
or ``TURBOWIRE_STORE_PASSWORD``), never from a config vLLM logs; an AUTH refusal is logged once,
saying what to set, instead of flapping the breaker like an outage.

A dead Redis must not slow a scheduler loop down: socket timeouts are short, and after one
failure every call raises :class:`DirectoryUnavailable` at once for ``retry_seconds`` (a circuit
breaker) before the network is tried again. Nothing read is unpickled: values are ints or JSON,
validated, and a malformed entry is skipped.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError as RedisAuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from turbowire.errors import TurboWireError
from turbowire.secret_file import read_secret_file
from turbowire.store.keys import CHUNK_HASH_BYTES, StoreKeyError, StoreScope

logger = logging.getLogger(__name__)

_ENGINE_ID_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
_HEX_RE = re.compile(rf"^[0-9a-f]{{{2 * CHUNK_HASH_BYTES}}}$")
_RANK_FIELD_RE = re.compile(r"^r(\d{1,4})$")
_SCAN_COUNT = 1000
_BATCH = 500
_MAX_INT = 1 << 62
#: An expired registration is deleted by the next engine that registers only this long after it
#: expired (so a registration racing the cleanup is never deleted while it is being renewed).
REGISTRY_GRACE_SECONDS = 60.0
#: Entries the registry hash may hold; an engine's registration beyond it is refused.
REGISTRY_MAX_ENTRIES = 4096

T = TypeVar("T")

ACCEPTED_SCHEMES = ("redis", "rediss")


class StoreUrlError(TurboWireError, ValueError):
    """A store URL this store cannot use (only ``redis://`` and ``rediss://`` are)."""

    reason = "bad_params"


def check_store_url(url: str) -> str:
    """Validate a store URL; ``redis://host[:port][/db]`` or ``rediss://...`` only."""
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ACCEPTED_SCHEMES:
        raise StoreUrlError(
            f"store URL {redact_url(str(url))!r} is not supported: use "
            "redis://host:port[/db] or rediss://host:port[/db] (resp:// and other LMCache "
            "schemes are refused: they corrupt variable-size objects)"
        )
    if not parts.hostname:
        raise StoreUrlError(f"store URL {redact_url(url)!r} has no host")
    try:
        parts.port
    except ValueError as exc:
        raise StoreUrlError(f"store URL {redact_url(url)!r} has a bad port: {exc}") from exc
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise StoreUrlError(
            f"store URL {redact_url(url)!r}: the path must be a database number (got {path!r})"
        )
    return url


def redact_url(url: str) -> str:
    """The URL without its password, in the userinfo or a ``password=`` query parameter (for
    logs and errors)."""
    try:
        parts = urlsplit(url)
        if parts.password is None and "password" not in parse_qs(parts.query):
            return url
        if parts.password is not None:
            netloc = parts.netloc.rsplit("@", 1)[-1]
            parts = parts._replace(netloc=f"{parts.username or ''}:***@{netloc}")
        if "password" in parse_qs(parts.query):
            query = "&".join("password=***" if q.split("=", 1)[0] == "password" else q
                             for q in parts.query.split("&"))
            parts = parts._replace(query=query)
        return urlunsplit(parts)
    except ValueError:
        return "<unparsable url>"


#: The store's Redis password: a file (a mounted Secret) wins over the variable itself.
STORE_PASSWORD_FILE_ENV = "TURBOWIRE_STORE_PASSWORD_FILE"
STORE_PASSWORD_ENV = "TURBOWIRE_STORE_PASSWORD"
#: The Redis ACL user of that password (unset: Redis's ``default`` user).
STORE_USERNAME_ENV = "TURBOWIRE_STORE_USERNAME"
#: What an AUTH refusal tells the operator (no password, or the wrong one).
STORE_AUTH_HINT = (
    f"set {STORE_PASSWORD_ENV} or {STORE_PASSWORD_FILE_ENV} (a file, e.g. a mounted Secret) to "
    f"the store's Redis password ({STORE_USERNAME_ENV} for a Redis ACL user)"
)


class StoreCredentialsError(TurboWireError, ValueError):
    """The store's password file cannot be used; the message names the file, never its content."""

    reason = "bad_params"


def _read_password_file(path: str) -> str:
    """The password in ``path`` (surrounding whitespace stripped); an empty file is an error
    (a broken mount, not "no password")."""
    text = read_secret_file(path, key=STORE_PASSWORD_FILE_ENV, holds="the store's Redis password",
                            error=StoreCredentialsError)
    if not text:
        raise StoreCredentialsError(
            f"{STORE_PASSWORD_FILE_ENV}={path!r} is empty: it must hold the store's Redis password")
    return text


def store_password(env: Mapping[str, str] | None = None) -> str | None:
    """The store's Redis password from the environment (never from a config or a URL that
    vLLM or a pod spec would show): ``TURBOWIRE_STORE_PASSWORD_FILE``, else
    ``TURBOWIRE_STORE_PASSWORD``, else None. Surrounding whitespace is ignored in both (a
    Secret's trailing newline; the chart's Redis strips it too)."""
    env = os.environ if env is None else env
    path = env.get(STORE_PASSWORD_FILE_ENV)
    if path:
        return _read_password_file(path)
    return (env.get(STORE_PASSWORD_ENV) or "").strip() or None


def _url_has_password(url: str) -> bool:
    parts = urlsplit(url)
    return parts.password is not None or "password" in parse_qs(parts.query)


def store_credentials(url: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``password``/``username`` keywords for redis-py's ``from_url`` from the environment;
    empty when ``url`` carries its own password (the URL wins) or no password is set."""
    if _url_has_password(url):
        return {}
    env = os.environ if env is None else env
    password = store_password(env)
    if password is None:
        return {}
    out = {"password": password}
    username = env.get(STORE_USERNAME_ENV)
    if username and urlsplit(url).username is None:
        out["username"] = username
    return out


def is_auth_error(exc: BaseException) -> bool:
    """True for Redis refusing this client's credentials (NOAUTH, WRONGPASS, AUTH without a
    configured password): a configuration error, not an outage."""
    return isinstance(exc, RedisAuthenticationError)


def auth_failure_message(url: str, exc: BaseException) -> str:
    """The one message an AUTH refusal logs (Redis's reply never contains the password)."""
    return f"Redis {redact_url(url)} refused authentication ({exc}): {STORE_AUTH_HINT}"


class DirectoryUnavailable(TurboWireError):
    """The directory's Redis did not answer (or failed recently: the breaker is open)."""

    reason = "store_unavailable"


@dataclass(frozen=True)
class EngineEntry:
    """One engine's registration: where to reach it and what it can reuse."""

    engine_id: str
    role: str
    side_channel: str  # "host:port"
    http_url: str | None
    scope: dict  # StoreScope.to_dict()
    record: dict  # compatibility record (opaque JSON-able dict)
    heartbeat: float = field(default=0.0)  # unix time of the last registration
    expires_at: float = field(default=0.0)  # unix time after which the entry is ignored

    @classmethod
    def from_json(cls, raw: bytes | str) -> EngineEntry | None:
        """The entry, or None when ``raw`` is not a well-formed registration."""
        try:
            data = json.loads(raw)
            if not isinstance(data, dict):
                return None
            engine_id, role, side = data["engine_id"], data["role"], data["side_channel"]
            http_url, scope, record = data.get("http_url"), data["scope"], data["record"]
            heartbeat = data["heartbeat"]
            expires_at = data.get("expires_at", 0.0)
            if not (isinstance(engine_id, str) and _ENGINE_ID_RE.match(engine_id)):
                return None
            if not isinstance(role, str) or not isinstance(side, str) or ":" not in side:
                return None
            if http_url is not None and not isinstance(http_url, str):
                return None
            if not isinstance(scope, dict) or not isinstance(record, dict):
                return None
            StoreScope.from_dict(scope)
            for value in (heartbeat, expires_at):
                if isinstance(value, bool) or not isinstance(value, (int, float)) \
                        or not math.isfinite(value):
                    return None
            return cls(engine_id, role, side, http_url, scope, record, float(heartbeat),
                       float(expires_at))
        except (ValueError, TypeError, KeyError, StoreKeyError, RecursionError, OverflowError):
            return None


def _as_count(value: object) -> int | None:
    """A stored byte count: a non-negative decimal integer, else None."""
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    if not isinstance(value, str) or not value.isdigit() or len(value) > 19:
        return None
    n = int(value)
    return n if n < _MAX_INT else None


def _chunk_key(scope: StoreScope, chunk_hash: bytes) -> str:
    if not isinstance(chunk_hash, (bytes, bytearray)) or len(chunk_hash) != CHUNK_HASH_BYTES:
        raise StoreKeyError(f"a chunk hash has {CHUNK_HASH_BYTES} bytes")
    return f"{scope.prefix}/{bytes(chunk_hash).hex()}"


def _batches(items: Sequence[T], n: int = _BATCH) -> Iterator[Sequence[T]]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


class Directory:
    """Which chunks are stored (per rank), and which engines are registered."""

    def __init__(self, url: str, *, ttl_seconds: float, socket_timeout_seconds: float = 0.25,
                 retry_seconds: float = 2.0) -> None:
        check_store_url(url)
        if not ttl_seconds > 0 or math.isinf(ttl_seconds):
            raise StoreKeyError(f"directory ttl_seconds must be positive (got {ttl_seconds})")
        self.url = url
        self.ttl_ms = max(1, int(ttl_seconds * 1000))
        self.retry_seconds = float(retry_seconds)
        self._lock = threading.Lock()
        self._down_until = 0.0
        # No retries: a refused connect must fail at once (the pool already replaces dead
        # connections it hands out); the breaker decides when to try again.
        self._client = redis.Redis.from_url(
            url, socket_timeout=socket_timeout_seconds,
            socket_connect_timeout=socket_timeout_seconds, retry=Retry(NoBackoff(), 0),
            max_connections=64, **store_credentials(url),
        )
        self._closed = False
        self._auth_logged = False

    # -- plumbing ------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """False while the breaker is open after a failure (no network I/O)."""
        return not self._closed and time.monotonic() >= self._down_until

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise DirectoryUnavailable("the directory is closed")
        if time.monotonic() < self._down_until:
            raise DirectoryUnavailable(f"directory {redact_url(self.url)} is down (retrying "
                                       f"after {self.retry_seconds:.1f}s)")
        try:
            return fn(*args, **kwargs)
        except RedisAuthenticationError as exc:
            raise self._auth_failed(what, exc) from exc
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            with self._lock:
                first = time.monotonic() >= self._down_until
                self._down_until = time.monotonic() + self.retry_seconds
            if first:
                logger.warning("directory %s unavailable in %s (%s: %s)",
                               redact_url(self.url), what, type(exc).__name__, exc)
            raise DirectoryUnavailable(f"directory {what}: {type(exc).__name__}") from exc
        except RedisError as exc:
            raise DirectoryUnavailable(f"directory {what}: {exc}") from exc

    def _auth_failed(self, what: str, exc: BaseException) -> DirectoryUnavailable:
        """Open the breaker and say what to set, once per directory (not at every retry: the
        credentials will not fix themselves)."""
        with self._lock:
            self._down_until = time.monotonic() + self.retry_seconds
            first, self._auth_logged = not self._auth_logged, True
        message = auth_failure_message(self.url, exc)
        if first:
            logger.error("directory %s: %s", what, message)
        return DirectoryUnavailable(f"directory {what}: {message}")

    def _pipeline(self, what: str, build: Any) -> list[Any]:
        """Run one pipelined round trip; per-command errors come back as exception objects."""
        def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            build(pipe)
            return pipe.execute(raise_on_error=False)

        results = self._call(what, run)
        for r in results:  # a connection error inside a pipeline is the whole trip's
            if is_auth_error(r):  # NOAUTH comes back per command
                raise self._auth_failed(what, r) from r
            if isinstance(r, (RedisConnectionError, RedisTimeoutError)):
                raise DirectoryUnavailable(f"directory {what}: {r}")
        return results

    # -- chunks --------------------------------------------------------------------------

    def publish(self, scope: StoreScope, entries: Sequence[tuple[bytes, int, int]]) -> None:
        """Record that these ranks' bytes of these chunks are stored (one round trip). A rank
        already listed is kept as it is (HSETNX): a save never rewrites what another engine
        published; the entry's TTL is refreshed."""
        rows: list[tuple[str, str, int]] = []
        for chunk_hash, rank, nbytes in entries:
            if not 0 <= rank < scope.tp_size:
                raise StoreKeyError(f"rank {rank} is outside tp_size {scope.tp_size}")
            if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
                raise StoreKeyError(f"nbytes must be a non-negative int (got {nbytes!r})")
            rows.append((_chunk_key(scope, chunk_hash), f"r{rank}", nbytes))
        if not rows:
            return

        def build(pipe: Any) -> None:
            seen: set[str] = set()
            for key, fld, nbytes in rows:
                pipe.hsetnx(key, fld, nbytes)
                seen.add(key)
            for key in seen:
                pipe.pexpire(key, self.ttl_ms)

        self._pipeline("publish", build)

    def touch(self, scope: StoreScope, hashes: Sequence[bytes]) -> None:
        """Refresh the TTL of these chunks' entries: an engine loaded them (only real loads keep
        entries alive; lookups never do)."""
        keys = [_chunk_key(scope, h) for h in hashes]
        if not keys:
            return

        def build(pipe: Any) -> None:
            for key in keys:
                pipe.pexpire(key, self.ttl_ms)

        self._pipeline("touch", build)

    def _rank_bytes(self, scope: StoreScope, hashes: Sequence[bytes],
                    what: str) -> tuple[list[str], list[list[int | None]]]:
        keys = [_chunk_key(scope, h) for h in hashes]
        fields = [f"r{r}" for r in range(scope.tp_size)]
        if not keys:
            return keys, []

        def build(pipe: Any) -> None:
            for key in keys:
                pipe.hmget(key, fields)

        rows: list[list[int | None]] = []
        for res in self._pipeline(what, build):
            if isinstance(res, Exception) or not isinstance(res, list):
                rows.append([None] * len(fields))  # e.g. WRONGTYPE: a malformed entry
            else:
                rows.append([None if v is None else _as_count(v) for v in res])
        return keys, rows

    def longest_prefix(self, scope: StoreScope, hashes: Sequence[bytes]) -> int:
        """How many leading chunks are stored on all ``scope.tp_size`` ranks (one pipelined
        round trip of reads; nothing is refreshed: see :meth:`touch`)."""
        _, rows = self._rank_bytes(scope, hashes, "longest_prefix")
        hits = 0
        for row in rows:
            if any(v is None for v in row):
                break
            hits += 1
        return hits

    def stored_bytes(self, scope: StoreScope, hashes: Sequence[bytes]) -> list[int]:
        """Per chunk, the bytes recorded over all ranks (0 = absent)."""
        _, rows = self._rank_bytes(scope, hashes, "stored_bytes")
        return [sum(v for v in row if v is not None) for row in rows]

    def forget(self, scope: StoreScope, hashes: Sequence[bytes]) -> None:
        """Drop these chunks' entries (a load found them gone or corrupt)."""
        keys = [_chunk_key(scope, h) for h in hashes]
        for batch in _batches(keys):
            self._call("forget", self._client.delete, *batch)

    # -- engines -------------------------------------------------------------------------

    @staticmethod
    def _registry_key(namespace: str) -> str:
        return f"{namespace}/engines"

    def register_engine(self, entry: EngineEntry, ttl_seconds: float) -> None:
        """(Re-)register an engine until ``ttl_seconds`` from now; heartbeat = now. Entries that
        expired more than :data:`REGISTRY_GRACE_SECONDS` ago are removed on the way."""
        scope = StoreScope.from_dict(entry.scope)
        if not isinstance(entry.engine_id, str) or not _ENGINE_ID_RE.match(entry.engine_id):
            raise StoreKeyError(f"engine_id {entry.engine_id!r} must be 1-128 of [A-Za-z0-9_.:-]")
        if not ttl_seconds > 0 or math.isinf(ttl_seconds):
            raise StoreKeyError(f"engine ttl_seconds must be positive (got {ttl_seconds})")
        now = time.time()
        data = asdict(entry)
        data["heartbeat"] = now
        data["expires_at"] = now + ttl_seconds
        try:
            value = json.dumps(data, allow_nan=False, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise StoreKeyError(f"engine entry is not JSON-able: {exc}") from exc
        key = self._registry_key(scope.namespace)

        def build(pipe: Any) -> None:
            pipe.hset(key, entry.engine_id, value)
            pipe.hgetall(key)

        written, current = self._pipeline("register_engine", build)
        if isinstance(written, Exception):  # e.g. WRONGTYPE: someone else's key of that name
            raise DirectoryUnavailable(f"directory register_engine: {written}")
        stale: list[bytes] = []
        newest = now + ttl_seconds
        for field_name, raw in (current.items() if isinstance(current, dict) else ()):
            other = EngineEntry.from_json(raw)
            if other is None or other.expires_at < now - REGISTRY_GRACE_SECONDS:
                stale.append(field_name)
            else:
                newest = max(newest, other.expires_at)
        live = len(current) - len(stale) if isinstance(current, dict) else 1
        if live > REGISTRY_MAX_ENTRIES:
            self._call("register_engine", self._client.hdel, key, entry.engine_id)
            raise StoreKeyError(f"the registry of {scope.namespace!r} holds {live} engines, "
                                f"more than {REGISTRY_MAX_ENTRIES}")

        def tidy(pipe: Any) -> None:
            if stale:
                pipe.hdel(key, *stale)
            pipe.pexpireat(key, int(newest * 1000) + 1)

        self._pipeline("register_engine", tidy)

    def engines(self, namespace: str) -> list[EngineEntry]:
        """The registered (not expired) engines of a namespace; malformed entries skipped. One
        HGETALL of the registry hash."""
        StoreScope(namespace, "x", "x", 1, 1, 1)  # validates the namespace
        raw_entries = self._call("engines", self._client.hgetall, self._registry_key(namespace))
        now = time.time()
        out: list[EngineEntry] = []
        for field_name, raw in (raw_entries.items() if isinstance(raw_entries, dict) else ()):
            entry = EngineEntry.from_json(raw)
            name = field_name.decode("utf-8", "replace") if isinstance(field_name, bytes) \
                else str(field_name)
            if entry is None or name != entry.engine_id \
                    or entry.scope.get("namespace") != namespace:
                logger.debug("skipping malformed engine entry %r", name[:80])
                continue
            if entry.expires_at <= now:
                continue
            out.append(entry)
        out.sort(key=lambda e: e.engine_id)
        return out

    def _scan(self, what: str, match: str, type_: str | None) -> list[bytes]:
        def run() -> list[bytes]:
            return list(self._client.scan_iter(match=match, count=_SCAN_COUNT, _type=type_))
        return self._call(what, run)

    def usage(self, namespace: str) -> tuple[int, int]:
        """(chunks, bytes) recorded in the namespace's directory (SCAN; for reports)."""
        StoreScope(namespace, "x", "x", 1, 1, 1)
        keys = [k for k in self._scan("usage", f"{namespace}/*", "hash")
                if self._is_chunk_key(k)]
        chunks = total = 0
        for batch in _batches(keys):
            def build(pipe: Any, batch: Sequence[bytes] = batch) -> None:
                for key in batch:
                    pipe.hgetall(key)

            for res in self._pipeline("usage", build):
                if isinstance(res, Exception) or not isinstance(res, dict) or not res:
                    continue
                counts = [_as_count(v) for f, v in res.items()
                          if _RANK_FIELD_RE.match(f.decode("ascii", "replace"))]
                if not counts or any(c is None for c in counts):
                    continue
                chunks += 1
                total += sum(c for c in counts if c is not None)
        return chunks, total

    @staticmethod
    def _is_chunk_key(key: bytes) -> bool:
        parts = key.decode("ascii", "replace").split("/")
        return len(parts) == 7 and bool(_HEX_RE.match(parts[6])) and parts[5].startswith("tp")

    def close(self) -> None:
        """Drop the connections (no I/O is waited on)."""
        self._closed = True
        try:
            self._client.close()
        except (RedisError, OSError) as exc:
            logger.debug("closing the directory client: %s", exc)


__all__ = [
    "STORE_PASSWORD_ENV", "STORE_PASSWORD_FILE_ENV", "STORE_USERNAME_ENV", "Directory",
    "DirectoryUnavailable", "EngineEntry", "StoreCredentialsError", "StoreUrlError",
    "auth_failure_message", "check_store_url", "is_auth_error", "redact_url", "store_credentials",
    "store_password",
]
