"""Per-step messages between the connector's scheduler side and worker side.

``TurboWireConnectorMetadata`` goes scheduler -> worker every step (what to encode into which
staging slots, what to load from which peer into which blocks). ``TurboWireWorkerMeta`` goes
worker -> scheduler (per-request load reports, merged across TP workers by ``aggregate``).
Both stay inside one engine (vLLM serializes them between its own processes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from turbowire.connector.config import DEFAULT_LEASE_SECONDS


@dataclass
class SaveBlock:
    """Encode tokens [0, num_tokens) of paged block ``block_id`` (request block ``index``)."""

    index: int
    block_id: int
    num_tokens: int
    slot: int
    tag: int


@dataclass
class SaveRequest:
    """Blocks to encode this step; ``block_ids[i]`` is the paged block of request block ``i``
    (the codec places token ``t`` by ``block_ids[t // block_size]``)."""

    request_id: str
    block_ids: list[int]
    blocks: list[SaveBlock]
    #: with several KV cache groups, every group's table (``block_ids`` is group 0's)
    group_tables: list[list[int]] = field(default_factory=list)

    def table(self, group: int) -> list[int]:
        """The block table of the layers of KV cache group ``group``."""
        return self.group_tables[group] if self.group_tables else self.block_ids


@dataclass
class LoadBlock:
    """Read request block ``index`` from remote ``slot`` and decode it into ``block_id``."""

    index: int
    block_id: int
    num_tokens: int
    slot: int
    tag: int


@dataclass
class PeerAddress:
    engine_id: str
    host: str
    port: int
    tp_size: int

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.engine_id, self.host, self.port)


@dataclass
class LoadRequest:
    """One request's load (or, with no blocks, only the lease release a prefill engine waits
    for).

    ``lease_token`` is the prefill lease's capability (``turbowire_lease_token`` of the
    request's params; "" from a peer that issued none): the worker presents it on the claim and
    the release. It is kept out of ``repr`` (log lines, tracebacks); the object travels from the
    scheduler to the workers only inside vLLM's own pickled scheduler output, never over the
    network.
    """

    request_id: str
    remote_request_id: str
    peer: PeerAddress
    blocks: list[LoadBlock]
    preset: str
    block_ids: list[int] = field(default_factory=list)  # local block of request block i
    #: with several KV cache groups, every group's table (``block_ids`` is group 0's)
    group_tables: list[list[int]] = field(default_factory=list, kw_only=True)
    lease_token: str = field(default="", repr=False, kw_only=True)
    # the prefill engine's lease (``turbowire_lease_seconds`` of the params, not this engine's
    # config): the handshake and the claim are retried only while that lease may still hold
    lease_seconds: float = field(default=DEFAULT_LEASE_SECONDS, kw_only=True)
    # this engine's own prompt, presented with the claim: the prefill engine refuses a lease
    # staged for another prompt (digest of the first ``prompt_tokens`` tokens; "": none)
    prompt_digest: str = field(default="", kw_only=True)
    prompt_tokens: int = field(default=0, kw_only=True)
    # set when the scheduler could not plan the load it announced to vLLM: the workers report
    # the request failed at once (by this reason) instead of leaving it waiting for KV forever
    fail_reason: str = field(default="", kw_only=True)

    @property
    def release_only(self) -> bool:
        return not self.blocks and not self.fail_reason

    def table(self, group: int) -> list[int]:
        """The block table of the layers of KV cache group ``group``."""
        return self.group_tables[group] if self.group_tables else self.block_ids


@dataclass
class StoreChunk:
    """One stored chunk of a request: tokens [token_start, token_start + chunk_tokens)."""

    token_start: int
    chunk_hash: bytes


@dataclass
class StoreSave:
    """Encode these full chunks of a request (computed this step) and store them."""

    request_id: str
    block_ids: list[int]  # the request's block table, at least up to the last chunk's end
    chunks: list[StoreChunk]


@dataclass
class StoreLoad:
    """Load these stored chunks into the request's blocks; tokens before ``first_token`` are
    already in vLLM's cache (its prefix cache) and are never written."""

    request_id: str
    block_ids: list[int]
    first_token: int
    chunks: list[StoreChunk]


@dataclass
class TurboWireConnectorMetadata(KVConnectorMetadata):
    saves: list[SaveRequest] = field(default_factory=list)
    loads: list[LoadRequest] = field(default_factory=list)
    store_saves: list[StoreSave] = field(default_factory=list)
    store_loads: list[StoreLoad] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.saves or self.loads or self.store_saves or self.store_loads)


@dataclass
class LoadReport:
    """What one worker measured for one request's load (sent back for kv_transfer_params)."""

    tokens: int = 0
    dense_bytes: int = 0
    wire_bytes: int = 0
    transfer_seconds: float = 0.0
    decode_seconds: float = 0.0
    handshake_seconds: float = 0.0
    wait_seconds: float = 0.0  # load queued -> READs posted
    failed: str | None = None
    source: str = "nixl"  # "nixl" (peer to peer) or "store"

    def merge(self, other: LoadReport) -> LoadReport:
        """Combine TP ranks: bytes add up, times take the slowest rank."""
        return LoadReport(
            tokens=max(self.tokens, other.tokens),
            dense_bytes=self.dense_bytes + other.dense_bytes,
            wire_bytes=self.wire_bytes + other.wire_bytes,
            transfer_seconds=max(self.transfer_seconds, other.transfer_seconds),
            decode_seconds=max(self.decode_seconds, other.decode_seconds),
            handshake_seconds=max(self.handshake_seconds, other.handshake_seconds),
            wait_seconds=max(self.wait_seconds, other.wait_seconds),
            failed=self.failed or other.failed,
            source=self.source,
        )

    def as_params(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "dense_bytes": self.dense_bytes,
            "wire_bytes": self.wire_bytes,
            "transfer_ms": round(self.transfer_seconds * 1e3, 3),
            "decode_ms": round(self.decode_seconds * 1e3, 3),
            "handshake_ms": round(self.handshake_seconds * 1e3, 3),
            "wait_ms": round(self.wait_seconds * 1e3, 3),
            "failed": self.failed,
            "source": self.source,
        }


@dataclass
class TurboWireWorkerMeta(KVConnectorWorkerMetadata):
    reports: dict[str, LoadReport] = field(default_factory=dict)
    # chunk hash (hex) -> TP ranks that stored it in their local tiers this interval
    stored: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, TurboWireWorkerMeta):
            return self
        merged = dict(self.reports)
        for rid, report in other.reports.items():
            merged[rid] = merged[rid].merge(report) if rid in merged else report
        stored = dict(self.stored)
        for chunk_hash, ranks in other.stored.items():
            stored[chunk_hash] = stored.get(chunk_hash, 0) + ranks
        return TurboWireWorkerMeta(merged, stored)


@dataclass
class TurboWireHandshakeMetadata(KVConnectorHandshakeMetadata):
    """A worker's NIXL agent and staging pool, handed to the scheduler's side channel."""

    agent_name: str
    agent_metadata: bytes
    base_addr: int
    slot_bytes: int
    num_slots: int
    layer_offsets: list[int]
    device_id: int
    mem_type: str
    head_groups: int = 1
