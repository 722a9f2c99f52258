"""Worker side of the connector: encode into staging (prefill), READ + verify + decode (decode).

Prefill: ``save_kv_layer`` encodes the planned blocks of each layer into the NIXL-registered
staging pool as soon as that layer's attention ran; ``wait_for_save`` covers layers vLLM did not
hand over (e.g. a draft model's) and synchronizes the device so the bytes are final before the
scheduler publishes them.

Decode: each load handshakes with the prefill engine once (cached per peer, in a thread so the
engine loop never blocks on the network), READs exactly the chunk bytes of the needed
(block, layer) pairs into a receive buffer, one READ per group of layers
(``decode_pipeline_groups``, two in flight), and decodes every chunk of a group (magic, version, preset,
geometry, tag and checksum verified by the codec) into the blocks vLLM allocated as soon as that
group has landed, while the later groups are still on the wire. Once every READ is done it tells
the prefill engine to release its lease. Any failure lands in ``failed_recving``; vLLM applies
``kv_load_failure_policy``.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from turbowire.connector.codecs import codec_format_version, make_codec
from turbowire.connector.compat import CompatibilityRecord, model_identity, speculative_factors
from turbowire.connector.config import TurboWireConfig
from turbowire.connector.geometry import GeometryError, KVGeometry, StagingLayout
from turbowire.connector.metadata import (
    LoadReport,
    LoadRequest,
    PeerAddress,
    SaveRequest,
    TurboWireConnectorMetadata,
    TurboWireHandshakeMetadata,
    TurboWireWorkerMeta,
)
from turbowire.connector.scheduler import TRANSPORT, draft_layer_predicate
from turbowire.connector.staging import ByteRanges
from turbowire.connector.stats import TurboWireConnectorStats
from turbowire.connector.transports.base import TransferState, TransportError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from turbowire.connector.sidechannel.client import PeerInfo
    from turbowire.connector.transports.nixl import NixlTransfer, NixlTransport

logger = logging.getLogger(__name__)

# Layer-group READs of one load on the wire at once: two keep the link busy while the group
# that landed is decoded, and the groups land one after another instead of all at the end.
READS_IN_FLIGHT = 2


class LoadFailed(RuntimeError):
    """A load failed; ``reason`` is the metric label (checksum, bounds, timeout, ...)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class PeerState:
    info: PeerInfo
    agent: str
    handshake_seconds: float


@dataclass
class LoadJob:
    load: LoadRequest
    created: float = field(default_factory=time.monotonic)
    recv_offset: int | None = None
    recv_nbytes: int = 0
    chunk_offsets: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    groups: list[range] = field(default_factory=list)  # layers of each READ
    xfers: list[NixlTransfer] = field(default_factory=list)  # posted READs, in group order
    group_descs: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    peer_agent: str = ""
    decoded: list[bool] = field(default_factory=list)
    transferred_at: float | None = None  # when the last READ was seen done
    decode_seconds: float = 0.0
    wait_seconds: float = 0.0  # queued -> READs posted (handshake, receive buffer)
    posted: float = 0.0
    handshake_seconds: float = 0.0
    claim: Future | None = None
    claimed: bool = False


def _failure_reason(exc: BaseException) -> str:
    """Map codec/kernel/transport exceptions to a metric reason without importing them eagerly."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    if "ChecksumError" in names:
        return "checksum"
    if "BlockIndexError" in names or "IndexError" in names:
        return "bounds"
    if "FormatError" in names or "CodecError" in names:
        return "format"
    if "IncompatiblePeerError" in names:
        return "incompatible"
    if "PeerUnreachableError" in names:
        return "peer_unreachable"
    if "SideChannelError" in names or "SideChannelProtocolError" in names:
        return "handshake"
    if "TransportError" in names:
        return "transport"
    return "internal"


def layer_groups(num_layers: int, groups: int) -> list[range]:
    """Split layers 0..num_layers-1 into at most ``groups`` contiguous, near-equal ranges."""
    groups = max(1, min(groups, num_layers))
    base, extra = divmod(num_layers, groups)
    out: list[range] = []
    start = 0
    for g in range(groups):
        size = base + (1 if g < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


class TurboWireWorker:
    """Worker-side state of one engine worker (one TP rank)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        config: TurboWireConfig,
        engine_id: str,
    ) -> None:
        self.vllm_config = vllm_config
        self.config = config
        self.engine_id = engine_id
        self._layouts_logged: set[tuple] = set()
        ktc = vllm_config.kv_transfer_config
        self.is_producer = bool(ktc.is_kv_producer)
        self.is_consumer = bool(ktc.is_kv_consumer)
        self.geometry = KVGeometry.from_kv_cache_config(
            kv_cache_config, draft_layer_predicate(vllm_config)
        )
        self.codec = make_codec(config.preset, self.geometry)
        self.layout = StagingLayout.build(
            self.geometry, self.codec.encoded_nbytes, config.staging_bytes
        )
        self.record = CompatibilityRecord.build(
            model=model_identity(vllm_config),
            geometry=self.geometry,
            preset=config.preset,
            codec_format_version=codec_format_version(),
            tp_size=vllm_config.parallel_config.tensor_parallel_size,
            speculative_config=speculative_factors(vllm_config),
        )
        self.layer_index = self.geometry.layer_index()
        self.stats = TurboWireConnectorStats()
        self.tp_rank = 0
        self.kv_caches: list[torch.Tensor] = []
        self.paged_layouts: list[Any] = []
        self.staging: torch.Tensor | None = None
        self.recv: torch.Tensor | None = None
        self.recv_ranges: ByteRanges | None = None
        self.transport: NixlTransport | None = None
        self.handshake_metadata: TurboWireHandshakeMetadata | None = None
        self.mem_type = "DRAM"
        self._sizes: dict[tuple[int, int], int] = {}
        self._saved_layers: set[int] = set()
        self._step_encode_seconds = 0.0
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tw-worker")
        self._clients: Any = None
        self._peers: dict[tuple[str, str, int], PeerState] = {}
        self._handshakes: dict[tuple[str, str, int], tuple[Future, float]] = {}
        self._jobs: list[LoadJob] = []
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._reports: dict[str, LoadReport] = {}
        self._quarantined_bytes = 0

    # ------------------------------------------------------------------ setup
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Order caches like the geometry, allocate + register the staging/receive buffers."""
        from turbowire.connector.sidechannel.client import ClientPool
        from turbowire.connector.transports.nixl import NixlTransport

        missing = [layer.name for layer in self.geometry.layers if layer.name not in kv_caches]
        if missing:
            raise GeometryError(f"vLLM registered no KV cache for layers {missing[:3]}")
        self.kv_caches = [kv_caches[layer.name] for layer in self.geometry.layers]
        self._check_cache_dtypes()
        self.paged_layouts = [self._layout_of(i, t) for i, t in enumerate(self.kv_caches)]
        device = self.kv_caches[0].device
        self.mem_type = "VRAM" if device.type == "cuda" else "DRAM"
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.tp_rank = get_tensor_model_parallel_rank()
        except (AssertionError, RuntimeError):
            self.tp_rank = 0
        self.transport = NixlTransport(
            agent_name=f"tw-{self.engine_id[:16]}-tp{self.tp_rank}-{id(self) & 0xFFFF:x}",
            backends=self.config.nixl_backends,
            backend_params=self.config.nixl_backend_params,
            progress_delay_us=self.config.nixl_progress_delay_us,
        )
        if self.is_producer:
            self.staging = torch.zeros(self.layout.pool_bytes, dtype=torch.uint8, device=device)
            self.transport.register(self.staging)
        if self.is_consumer:
            self.recv = torch.zeros(self.config.recv_bytes, dtype=torch.uint8, device=device)
            self.transport.register(self.recv)
            self.recv_ranges = ByteRanges(self.config.recv_bytes)
            self._clients = ClientPool(self.config.auth_token, self.config.handshake_timeout_seconds)
        base = self.staging.data_ptr() if self.staging is not None else 0
        self.handshake_metadata = TurboWireHandshakeMetadata(
            agent_name=self.transport.agent_name,
            agent_metadata=self.transport.local_metadata(),
            base_addr=base,
            slot_bytes=self.layout.slot_bytes,
            num_slots=self.layout.num_slots,
            layer_offsets=list(self.layout.layer_offsets),
            device_id=max(device.index or 0, 0),
            mem_type=self.mem_type,
        )
        self.stats.set_gauge("staging_capacity_bytes", self.layout.pool_bytes if self.is_producer else 0)
        logger.info(
            "turbowire worker tp%d: %d layers registered, staging %d B, recv %d B (%s)",
            self.tp_rank,
            len(self.kv_caches),
            self.layout.pool_bytes if self.is_producer else 0,
            self.config.recv_bytes if self.is_consumer else 0,
            self.mem_type,
        )

    def _check_cache_dtypes(self) -> None:
        """bf16/fp16 caches anywhere; fp8 e4m3 caches in vLLM's GPU layout, with the layer's
        scales readable from vLLM's attention layer (checked now, read again per call). Layers
        are coded one by one, so a draft model's cache may have another dtype."""
        from turbowire.kernels.fp8_cache import FP8_CACHE_DTYPES, is_fp8_cache

        odd = {t.dtype for t in self.kv_caches} - {torch.bfloat16, torch.float16, *FP8_CACHE_DTYPES}
        if odd:
            raise GeometryError(
                f"the TurboWire connector serves bf16, fp16 or fp8 e4m3 KV caches, not "
                f"{sorted(map(str, odd))}"
            )
        for layer, cache in enumerate(self.kv_caches):
            if not is_fp8_cache(cache):
                continue
            if cache.dim() != 5:
                raise GeometryError(
                    "fp8 KV caches are served in vLLM's GPU cache layout (5-D); this engine's are "
                    "CPU attention caches: run vLLM with --kv-cache-dtype auto"
                )
            self._kv_scales(layer)

    def _kv_scales(self, layer: int) -> tuple[float, float] | None:
        """The layer's fp8 (K, V) scales as vLLM's attention layer holds them, read per call
        (vLLM may compute them on the first forward pass); None for bf16/fp16 caches."""
        from turbowire.kernels.fp8_cache import is_fp8_cache

        if not is_fp8_cache(self.kv_caches[layer]):
            return None
        name = self.geometry.layers[layer].name
        context = getattr(getattr(self.vllm_config, "compilation_config", None),
                          "static_forward_context", None) or {}
        attn = context.get(name)
        if attn is None or not hasattr(attn, "_k_scale_float") or not hasattr(attn, "_v_scale_float"):
            raise GeometryError(
                f"fp8 KV cache of layer {name}: vLLM's attention layer with its k/v scales is not "
                "in the static forward context"
            )
        return float(attn._k_scale_float), float(attn._v_scale_float)

    def _layout_of(self, layer: int, cache: torch.Tensor) -> Any:
        """The cache's layout; on CPU with the placement vLLM's attention really uses (probed
        with vLLM's own cache-write op for the ISA the layer's attention runs)."""
        from turbowire.kernels import PagedKVLayout

        if cache.dim() == 4 and cache.device.type == "cpu":
            from turbowire.kernels.cpu_attn_layout import cpu_attn_layout

            isa = self._attn_isa(layer)
            layout = cpu_attn_layout(cache, self.geometry.head_dim, isa)
            key = (layout.isa, layout.describe(), cache.dtype, layout.block_size)
            if key not in self._layouts_logged:
                self._layouts_logged.add(key)
                from turbowire.kernels.cpu_dispatch import served_by

                log = logger.warning if layout.path == "generic" else logger.info
                log(
                    "vLLM CPU attention isa %s (%s, block size %d, head_dim %d): KV placed %s; "
                    "turbowire serves it with %s",
                    layout.isa, str(cache.dtype).replace("torch.", ""), layout.block_size,
                    layout.head_dim, layout.describe(), served_by(layout),
                )
            return layout
        return PagedKVLayout.from_cache(cache, head_dim=self.geometry.head_dim)

    def _attn_isa(self, layer: int) -> str | None:
        """The ISA vLLM set on the layer's attention (None: let vLLM's rule pick it)."""
        name = self.geometry.layers[layer].name
        context = getattr(getattr(self.vllm_config, "compilation_config", None),
                          "static_forward_context", None) or {}
        isa = getattr(context.get(name), "isa", None)
        return isa if isinstance(isa, str) and isa else None

    def chunk_nbytes(self, layer: int, num_tokens: int, block_index: int) -> int:
        """Exact bytes of the chunk of request block ``block_index`` (the first block of a
        sequence carries extra rows, so the size depends on where the block starts)."""
        key = (layer, num_tokens, block_index == 0)
        size = self._sizes.get(key)
        if size is None:
            heads = self.geometry.layers[layer].num_kv_heads
            offset = block_index * self.geometry.block_size
            size = int(self.codec.encoded_nbytes(layer, num_tokens, heads, offset))
            self._sizes[key] = size
        return size

    # ------------------------------------------------------------------ prefill: encode
    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, meta: TurboWireConnectorMetadata
    ) -> None:
        if not meta.saves or self.staging is None:
            return
        layer = self.layer_index.get(layer_name)
        if layer is None or layer in self._saved_layers:
            return
        self._encode_layer(layer, kv_layer, meta.saves)
        self._saved_layers.add(layer)

    def wait_for_save(self, meta: TurboWireConnectorMetadata | None) -> None:
        if meta is None or not meta.saves or self.staging is None:
            self._saved_layers.clear()
            return
        for layer in range(self.geometry.num_layers):
            if layer not in self._saved_layers:
                self._encode_layer(layer, self.kv_caches[layer], meta.saves)
        if self.staging.device.type == "cuda":
            torch.cuda.current_stream(self.staging.device).synchronize()
        dense = wire = 0
        elem = self.kv_caches[0].element_size()
        for save in meta.saves:
            for block in save.blocks:
                dense += block.num_tokens * self.geometry.dense_bytes_per_token(elem)
                wire += sum(
                    self.chunk_nbytes(layer, block.num_tokens, block.index)
                    for layer in range(self.geometry.num_layers)
                )
        self.stats.record_send(TRANSPORT, self.config.preset, dense, wire)
        self.stats.observe(
            "encode_seconds", self._step_encode_seconds, transport=TRANSPORT,
            preset=self.config.preset,
        )
        self._step_encode_seconds = 0.0
        self._saved_layers.clear()

    def _encode_layer(self, layer: int, cache: torch.Tensor, saves: list[SaveRequest]) -> None:
        from turbowire.kernels import EncodeItem, encode_into

        assert self.staging is not None
        items = []
        limits = []
        expected = []
        bs = self.geometry.block_size
        for save in saves:
            for block in save.blocks:
                items.append(
                    EncodeItem(
                        block_ids=save.block_ids,
                        token_start=block.index * bs,
                        num_tokens=block.num_tokens,
                        out_offset=self.layout.chunk_offset(block.slot, layer),
                        tag=block.tag,
                    )
                )
                limits.append(self.layout.full_chunk_bytes[layer])
                expected.append(self.chunk_nbytes(layer, block.num_tokens, block.index))
        t0 = time.perf_counter()
        layout = self.paged_layouts[layer]
        written = encode_into(self.codec, layer, cache, layout, items, self.staging,
                              kv_scales=self._kv_scales(layer))
        self._step_encode_seconds += time.perf_counter() - t0
        for n, limit, want in zip(written, limits, expected, strict=True):
            if n > limit:  # would have spilled into the next layer's chunk
                raise RuntimeError(
                    f"codec wrote {n} bytes for a block of layer {layer}, slot room is {limit}"
                )
            if n != want:
                raise RuntimeError(f"codec wrote {n} bytes, encoded_nbytes promised {want}")

    # ------------------------------------------------------------------ decode: load
    def start_load_kv(self, meta: TurboWireConnectorMetadata) -> None:
        for load in meta.loads:
            if load.release_only:
                self._release_async(load)
            else:
                self._jobs.append(LoadJob(load))
        self._progress()

    def get_transfer_results(self) -> tuple[set[str], set[str]]:
        """(finished incl. failed, failed) since the last call."""
        self._progress()
        finished, failed = self._finished | self._failed, self._failed
        self._finished, self._failed = set(), set()
        return finished, failed

    def take_reports(self) -> TurboWireWorkerMeta | None:
        if not self._reports:
            return None
        meta = TurboWireWorkerMeta(self._reports)
        self._reports = {}
        return meta

    def get_stats(self) -> TurboWireConnectorStats | None:
        if self.stats.is_empty():
            return None
        return self.stats.clone_and_reset()

    def _progress(self) -> None:
        if not self._jobs:
            return
        now = time.monotonic()
        still: list[LoadJob] = []
        for job in self._jobs:
            try:
                if self._advance(job, now):
                    continue  # finished
            except LoadFailed as exc:
                self._fail(job, exc.reason, str(exc))
                continue
            except Exception as exc:  # noqa: BLE001 - every failure must reach failed_recving
                reason = _failure_reason(exc)
                self._fail(job, reason, f"{type(exc).__name__}: {exc}")
                continue
            still.append(job)
        self._jobs = still

    def _advance(self, job: LoadJob, now: float) -> bool:
        """Move a job forward; True when it completed successfully."""
        if now - job.created > self.config.transfer_timeout_seconds:
            raise LoadFailed(
                "timeout",
                f"load did not finish within transfer_timeout_seconds="
                f"{self.config.transfer_timeout_seconds}",
            )
        if not job.xfers:
            peer = self._peer_for(job)
            if peer is None:
                return False
            self._claimed(job)  # the claim's round trip runs while the READs move
            if not self._post(job, peer):
                return False
        if not self._claimed(job):
            return False  # nothing is decoded before the lease is confirmed
        # decode the groups that have landed, in order; the next READ goes out before a group is
        # decoded, so the link stays busy while the CPU/GPU decodes
        for g in range(len(job.xfers)):
            if job.decoded[g]:
                continue
            state = job.xfers[g].state()
            if state is TransferState.PENDING:
                break
            if state is TransferState.FAILED:
                raise LoadFailed("transport", f"NIXL READ of layer group {g} finished in error")
            job.xfers[g].release()
            job.decoded[g] = True  # even if decoding raises: the handle is released
            self._post_more(job)
            job.decode_seconds += self._decode(job, job.groups[g])
        if len(job.xfers) < len(job.groups) or not all(job.decoded):
            return False
        if job.transferred_at is None:
            job.transferred_at = time.perf_counter()
        transfer_seconds = job.transferred_at - job.posted
        self._release_async(job.load)
        self._free_recv(job)
        self._complete(job, transfer_seconds, job.decode_seconds)
        return True

    def _peer_for(self, job: LoadJob) -> PeerState | None:
        peer = job.load.peer
        state = self._peers.get(peer.key)
        if state is not None:
            return state
        pending = self._handshakes.get(peer.key)
        if pending is None:
            future = self._executor.submit(self._handshake_rpc, peer)
            self._handshakes[peer.key] = (future, time.perf_counter())
            return None
        future, started = pending
        if not future.done():
            return None
        del self._handshakes[peer.key]
        info = future.result()  # raises the handshake's error for this job (retried next job)
        self._check_peer_geometry(info, peer)
        assert self.transport is not None
        agent = self.transport.add_peer(info.staging.agent_metadata)  # main thread only
        elapsed = time.perf_counter() - started
        state = PeerState(info, agent, elapsed)
        self._peers[peer.key] = state
        self.stats.observe("handshake_seconds", elapsed, transport=TRANSPORT, preset=self.config.preset)
        job.handshake_seconds = elapsed
        logger.info(
            "handshake with prefill engine %s at %s:%d done in %.1f ms",
            peer.engine_id, peer.host, peer.port, elapsed * 1e3,
        )
        return state

    def _claimed(self, job: LoadJob) -> bool:
        """Extend the prefill lease (one heartbeat round trip, sent when the READs are posted):
        a slot is only decoded once its lease is known to have held, so an expired (possibly
        reused) slot is never decoded. Bytes read from a slot reused meanwhile would also fail
        the chunk tag or checksum."""
        if job.claimed:
            return True
        if job.claim is None:
            load = job.load
            client = self._clients.get(load.peer.host, load.peer.port)
            job.claim = self._executor.submit(
                client.heartbeat, [load.remote_request_id], self.engine_id
            )
            return False
        if not job.claim.done():
            return False
        reply = job.claim.result()
        if job.load.remote_request_id in reply.unknown:
            raise LoadFailed(
                "lease_expired",
                f"the prefill engine no longer holds request {job.load.remote_request_id} "
                "(lease expired before the decode engine got to it; raise lease_seconds)",
            )
        job.claimed = True
        return True

    def _handshake_rpc(self, peer: PeerAddress) -> PeerInfo:
        """Network part of the handshake (thread pool; no NIXL calls here)."""
        client = self._clients.get(peer.host, peer.port)
        return client.handshake(self.record, self.engine_id, self.tp_rank)

    def _check_peer_geometry(self, info: PeerInfo, peer: PeerAddress) -> None:
        from turbowire.connector.compat import IncompatiblePeerError

        if info.engine_id != peer.engine_id:
            raise IncompatiblePeerError(
                "engine_id", peer.engine_id, info.engine_id,
                message=f"{peer.host}:{peer.port} now serves engine {info.engine_id}, not "
                f"{peer.engine_id} (restarted?): its staged KV is gone",
            )
        staging = info.staging
        if staging.mem_type != self.mem_type:
            raise LoadFailed("incompatible", f"peer staging is {staging.mem_type}, ours {self.mem_type}")
        if len(staging.layer_offsets) != self.geometry.num_layers:
            raise LoadFailed("incompatible", "peer staging has a different layer count")
        for layer, off in enumerate(staging.layer_offsets):
            if off + self.layout.full_chunk_bytes[layer] > staging.slot_bytes:
                raise LoadFailed("bounds", f"peer slot too small for layer {layer}")

    def _post(self, job: LoadJob, peer: PeerState) -> bool:
        assert self.recv is not None and self.recv_ranges is not None and self.transport
        staging = peer.info.staging
        load = job.load
        slots = [b.slot for b in load.blocks]
        bad = [s for s in slots if not 0 <= s < staging.num_slots]
        if bad:
            raise LoadFailed("bounds", f"staging slots {bad[:5]} outside the peer's {staging.num_slots}")
        num_blocks = self.paged_layouts[0].num_blocks
        bad_local = [b for b in load.block_ids if not 0 <= b < num_blocks]
        if bad_local:
            raise LoadFailed("bounds", f"local block ids {bad_local[:5]} out of range")
        for block in load.blocks:
            if not 0 < block.num_tokens <= self.geometry.block_size:
                raise LoadFailed("bounds", f"block with {block.num_tokens} tokens")
        groups = layer_groups(self.geometry.num_layers, self.config.decode_pipeline_groups)
        offsets: dict[tuple[int, int], tuple[int, int]] = {}
        local_rows: list[list[tuple[int, int]]] = []
        remote_rows: list[list[tuple[int, int, int]]] = []
        cursor = 0
        for layers in groups:  # each group's chunks are contiguous in the receive range
            local_rows.append([])
            remote_rows.append([])
            for layer in layers:
                for bi, block in enumerate(load.blocks):
                    size = self.chunk_nbytes(layer, block.num_tokens, block.index)
                    offsets[(bi, layer)] = (cursor, size)
                    remote_rows[-1].append(
                        (
                            staging.base_addr
                            + block.slot * staging.slot_bytes
                            + staging.layer_offsets[layer],
                            size,
                            staging.device_id,
                        )
                    )
                    local_rows[-1].append((cursor, size))
                    cursor += size
        if cursor > self.recv_ranges.capacity:
            raise LoadFailed(
                "recv_buffer_too_small",
                f"request needs {cursor} B of receive buffer, recv_bytes is "
                f"{self.recv_ranges.capacity}: raise recv_bytes",
            )
        start = self.recv_ranges.allocate(cursor)
        if start is None:
            return False  # wait for other loads to free the buffer
        job.recv_offset, job.recv_nbytes, job.chunk_offsets = start, cursor, offsets
        job.groups = groups
        base = self.recv.data_ptr() + start
        device_id = max(self.recv.device.index or 0, 0)
        job.group_descs = [
            (
                np.array([(base + off, size, device_id) for off, size in local_group], np.uint64),
                np.array(remote_group, dtype=np.uint64),
            )
            for local_group, remote_group in zip(local_rows, remote_rows, strict=True)
        ]
        job.peer_agent = peer.agent
        job.posted = time.perf_counter()  # UCX may finish small READs inside the post call
        job.wait_seconds = time.monotonic() - job.created
        self._post_more(job)
        return True

    def _post_more(self, job: LoadJob) -> None:
        """Keep READS_IN_FLIGHT layer groups on the wire. Posting every group at once made them
        share the link and land together at the end, leaving nothing to overlap the decode with."""
        assert self.transport is not None
        in_flight = sum(1 for g in range(len(job.xfers)) if not job.decoded[g])
        while in_flight < READS_IN_FLIGHT and len(job.xfers) < len(job.groups):
            local, remote = job.group_descs[len(job.xfers)]
            try:
                xfer = self.transport.read(job.peer_agent, local, remote, self.mem_type)
            except TransportError:
                if not job.xfers:
                    self._free_recv(job)
                raise  # READs already posted may still land: _fail quarantines the range
            job.xfers.append(xfer)
            job.decoded.append(False)
            in_flight += 1

    def _decode(self, job: LoadJob, layers: range) -> float:
        """Verify and decode the chunks of ``layers`` (one landed READ) into the cache."""
        from turbowire.kernels import DecodeItem, decode_into

        assert self.recv is not None and job.recv_offset is not None
        t0 = time.perf_counter()
        bs = self.geometry.block_size
        table = job.load.block_ids
        for layer in layers:
            items = []
            for bi, block in enumerate(job.load.blocks):
                off, size = job.chunk_offsets[(bi, layer)]
                if block.index >= len(table) or table[block.index] != block.block_id:
                    raise LoadFailed("bounds", f"block table does not map block {block.index}")
                items.append(
                    DecodeItem(
                        block_ids=table,
                        token_start=block.index * bs,
                        num_tokens=block.num_tokens,
                        in_offset=job.recv_offset + off,
                        nbytes=size,
                        expected_tag=block.tag,
                    )
                )
            layout = self.paged_layouts[layer]
            decode_into(self.codec, layer, self.kv_caches[layer], layout, items, self.recv,
                        kv_scales=self._kv_scales(layer))
        if self.recv.device.type == "cuda":
            torch.cuda.current_stream(self.recv.device).synchronize()
        return time.perf_counter() - t0

    def _complete(self, job: LoadJob, transfer_seconds: float, decode_seconds: float) -> None:
        load = job.load
        tokens = sum(b.num_tokens for b in load.blocks)
        elem = self.kv_caches[0].element_size()
        dense = tokens * self.geometry.dense_bytes_per_token(elem)
        wire = job.recv_nbytes
        self.stats.record_recv(TRANSPORT, load.preset, dense, wire)
        self.stats.observe("transfer_seconds", transfer_seconds, transport=TRANSPORT, preset=load.preset)
        self.stats.observe("decode_seconds", decode_seconds, transport=TRANSPORT, preset=load.preset)
        self._finished.add(load.request_id)
        self._reports[load.request_id] = LoadReport(
            tokens=tokens,
            dense_bytes=dense,
            wire_bytes=wire,
            transfer_seconds=transfer_seconds,
            decode_seconds=decode_seconds,
            handshake_seconds=job.handshake_seconds,
            wait_seconds=job.wait_seconds,
        )
        logger.debug(
            "loaded %s: %d tokens, %d wire B (%.2fx), wait %.1f ms, transfer %.1f ms, "
            "decode %.1f ms", load.request_id, tokens, wire, dense / max(wire, 1),
            job.wait_seconds * 1e3, transfer_seconds * 1e3, decode_seconds * 1e3,
        )

    def _fail(self, job: LoadJob, reason: str, message: str) -> None:
        load = job.load
        logger.error(
            "KV load of request %s from engine %s failed (%s): %s",
            load.request_id, load.peer.engine_id, reason, message,
        )
        self.stats.record_failure(reason)
        in_flight = [
            x for g, x in enumerate(job.xfers)
            if not job.decoded[g] and x.state() is TransferState.PENDING
        ]
        if in_flight and job.recv_offset is not None:
            # A READ may still write into the receive range: never reuse it.
            self._quarantined_bytes += job.recv_nbytes
            job.recv_offset = None
        else:
            self._free_recv(job)
        for g, x in enumerate(job.xfers):
            if not job.decoded[g] and x.state() is not TransferState.PENDING:
                x.release()
                job.decoded[g] = True
        self._release_async(load)
        self._failed.add(load.request_id)
        self._reports[load.request_id] = LoadReport(failed=reason)

    def _free_recv(self, job: LoadJob) -> None:
        if job.recv_offset is not None and self.recv_ranges is not None:
            self.recv_ranges.free(job.recv_offset, job.recv_nbytes)
            job.recv_offset = None

    def _release_async(self, load: LoadRequest) -> None:
        """Tell the prefill engine it may free the staged slots (fire and forget, logged)."""
        if self._clients is None:
            return

        def call() -> None:
            try:
                reply = self._clients.get(load.peer.host, load.peer.port).release(
                    [load.remote_request_id], self.engine_id, self.tp_rank
                )
                if reply.unknown:
                    logger.warning(
                        "prefill engine %s had no lease for %s any more (expired?)",
                        load.peer.engine_id, load.remote_request_id,
                    )
            except Exception as exc:  # noqa: BLE001 - the lease then expires on its own
                logger.warning("lease release for %s failed: %s", load.remote_request_id, exc)
                self.stats.record_failure("peer_unreachable")

        self._executor.submit(call)

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._clients is not None:
            self._clients.close()
        if self.transport is not None:
            self.transport.close()
            self.transport = None
