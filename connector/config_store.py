"""The store path's keys: ``transport`` (peer to peer over NIXL, the store, or both) and where
the store keeps its compressed chunks (``store_url``, ``directory_url``, the local tiers), for
how long, under which namespace and in which chunk size: their rows of the table and their
defaults (which the proxy and the demo import, through ``config_keys``), in one place.
"""

from __future__ import annotations

import re

from turbowire.connector.config_key import ConfigKey
from turbowire.connector.config_kinds import Choice, Int, Seconds, Size, Text

__all__ = [
    "DEFAULT_STORE_CHUNK_TOKENS", "DEFAULT_STORE_LOCAL_CPU_BYTES", "DEFAULT_STORE_TTL_SECONDS",
    "REDIS_URL", "STORE_KEYS", "STORE_NAME_RE", "STORE_URL_SCHEMES", "TRANSPORTS",
]

TRANSPORTS = ("nixl", "store", "both")
STORE_URL_SCHEMES = ("redis://", "rediss://")
DEFAULT_STORE_LOCAL_CPU_BYTES = 1 << 30
DEFAULT_STORE_TTL_SECONDS = 3600.0
DEFAULT_STORE_CHUNK_TOKENS = 256
STORE_NAME_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,64}$")


REDIS_URL = Text(
    "a redis:// or rediss:// URL",
    ((lambda s: s.startswith(STORE_URL_SCHEMES) and len(s) > len("redis://"),
      "{key}={value!r} is not supported: use redis://HOST:PORT (or rediss://)"),),
    nullable=True,
)


#: The store path's rows of ``config_keys.CONFIG_KEYS``, the last ones of the table.
STORE_KEYS: tuple[ConfigKey, ...] = (
    ConfigKey(
        "transport",
        Choice(TRANSPORTS),
        "`nixl`: P/D hand-off peer to peer over NIXL. `store`: every engine saves the compressed "
        "full chunks of the prompts it computes into the store (LMCache tiers, Redis) and loads "
        "any stored prefix of a new prompt instead of computing it. `both`: the NIXL hand-off, "
        "and every computed chunk also stored. A request opts out of saving with "
        '`kv_transfer_params: {"turbowire_store": false}`.',
        default="nixl",
    ),
    ConfigKey(
        "store_url",
        REDIS_URL,
        "Where the store's bytes live, shared by engines: `redis://HOST:PORT[/DB]` (or "
        "`rediss://`), reached through LMCache's remote backend with turbowire's Redis plugin. "
        "Unset: only this engine's local tiers. With only `store_url` set, the directory lives "
        "in the same Redis.",
    ),
    ConfigKey(
        "directory_url",
        REDIS_URL,
        "The chunk directory and engine registry (Redis): which chunks are stored, which engines "
        "serve them. The scheduler answers lookups from it without reading the bytes.",
        default_doc="= `store_url`",
        derive=lambda values, env: values["store_url"],
    ),
    ConfigKey(
        "store_local_cpu_bytes",
        Size(0),
        "LMCache local CPU tier of this engine (compressed chunks in host memory); `0` = off.",
        default=DEFAULT_STORE_LOCAL_CPU_BYTES,
    ),
    ConfigKey(
        "store_local_disk",
        Text("a directory path", ((bool, "{key} must be a directory path"),), nullable=True),
        "LMCache local disk tier (a directory, one per engine); unset = off. LMCache keeps its "
        "disk index in memory only; turbowire rebuilds it from the files at start, so chunks "
        "survive an engine restart.",
    ),
    ConfigKey(
        "store_ttl_seconds",
        Seconds(1.0),
        "Lifetime of a stored chunk and its directory entry in Redis, refreshed when an engine "
        "loads the chunk (lookups, the proxy's included, never refresh it).",
        default=DEFAULT_STORE_TTL_SECONDS,
    ),
    ConfigKey(
        "store_namespace",
        Text(
            "1-64 of letters, digits and `_.:-`",
            ((lambda s: bool(STORE_NAME_RE.match(s)),
              "{key}={value!r} must be 1-64 characters of letters, digits and _.:-"),),
        ),
        "Prefix of every store and directory key: deployments sharing a Redis never see each "
        "other's chunks.",
        default="turbowire",
    ),
    ConfigKey(
        "store_chunk_tokens",
        Int(1, 1 << 16, " (a multiple of the KV block size)"),
        "Tokens per stored chunk (a multiple of the block size). Only full chunks are stored; "
        "a chunk is reused only after the identical prefix "
        "under the same `cache_salt`, LoRA adapter and images.",
        default=DEFAULT_STORE_CHUNK_TOKENS,
    ),
)
