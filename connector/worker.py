"""Worker side of the connector: register caches, encode into staging, hand loads to the loader.

Prefill: ``save_kv_layer`` encodes the planned blocks of each layer into the transport-registered
staging pool as soon as that layer's attention ran; ``wait_for_save`` covers layers vLLM did not
hand over (e.g. a draft model's) and makes the bytes final before the scheduler publishes them.
Both go through the worker's cache coder (``connector/coder``, chosen once by ``make_coder``:
on CUDA caches one plan per step, encodes on a side stream ordered by events, no host
synchronisation; elsewhere the C codec per layer, bytes final when ``wait_for_save`` returns).

Decode: the load state machine is :class:`turbowire.connector.loader.KVLoader`; this module gives
it the transport, the side-channel clients and the coder's decode of a landed layer group into
the paged cache (magic, version, preset, geometry, tag and checksum verified by the kernels
before anything is written). The store path (``store_worker``) shares the same coder.
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Any, Literal

import torch

from turbowire.connector import threads
from turbowire.connector.caches import EngineCaches
from turbowire.connector.codecs import chunk_nbytes
from turbowire.connector.coder import CacheCoder, make_coder
from turbowire.connector.config import TurboWireConfig
from turbowire.connector.loader import KVLoader, LocalEnd
from turbowire.connector.metadata import (
    TurboWireConnectorMetadata,
    TurboWireHandshakeMetadata,
    TurboWireWorkerMeta,
)
from turbowire.connector.sidechannel.client import PeerExecutors
from turbowire.connector.spec import EngineSetup
from turbowire.connector.staging import ByteRanges
from turbowire.connector.stats import P2P_LABEL, TurboWireConnectorStats
from turbowire.connector.transports import Transport, make_transport

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from turbowire.connector.store_worker import StoreWorker

logger = logging.getLogger(__name__)


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
        # save_schedule: encode each layer from save_kv_layer, or all of them in wait_for_save
        self._layerwise = config.save_schedule == "layerwise"
        setup = EngineSetup.build(vllm_config, kv_cache_config, config)
        self.is_producer, self.is_consumer = setup.is_producer, setup.is_consumer
        self.geometry, self.codec = setup.geometry, setup.codec
        self.layout, self.record = setup.layout, setup.record
        self.store_scope = setup.store_scope
        self.store: StoreWorker | None = None
        self.layer_index = self.geometry.layer_index()
        self.stats = TurboWireConnectorStats()
        self.tp_rank = 0
        self.caches: EngineCaches | None = None
        self.staging: torch.Tensor | None = None
        self.recv: torch.Tensor | None = None
        self.recv_ranges: ByteRanges | None = None
        self.transport: Transport | None = None
        self.loader: KVLoader | None = None
        self.handshake_metadata: TurboWireHandshakeMetadata | None = None
        self.mem_type = "DRAM"
        self._sizes: dict[tuple[int, int, bool, int], int] = {}
        self._saved_layers: set[int] = set()
        # side-channel calls (handshakes, claims, releases) on per-peer lanes: a prefill engine
        # that never answers holds up its own loads only (one pool for all peers stalled every
        # peer's loads behind two such calls)
        self._executor = PeerExecutors(
            max_peers=config.max_peers, threads_per_peer=2, thread_name_prefix="tw-worker",
            initializer=threads.pin_current_thread,
            initargs=(threads.resolve(config.connector_thread_cpus),),
        )
        self._clients = None
        self.coder: CacheCoder | None = None  # chosen once the caches are registered

    # ------------------------------------------------------------------ setup
    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.caches.tensors if self.caches is not None else []

    @property
    def paged_layouts(self) -> list:
        return self.caches.layouts if self.caches is not None else []

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Order caches like the geometry, allocate + register the staging/receive buffers."""
        from turbowire.connector.sidechannel.client import ClientPool

        self.caches = EngineCaches(self.vllm_config, self.geometry, kv_caches)
        device = self.caches.device
        self.mem_type = "VRAM" if device.type == "cuda" else "DRAM"
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.tp_rank = get_tensor_model_parallel_rank()
        except (AssertionError, RuntimeError):
            self.tp_rank = 0
        transport = None
        if self.config.uses_nixl:
            transport = self.transport = make_transport(self.config, self._agent_name())
            if self.is_producer:
                self.staging = torch.zeros(self.layout.pool_bytes, dtype=torch.uint8,
                                           device=device)
                transport.register(self.staging)
            if self.is_consumer:
                self.recv = torch.zeros(self.config.recv_bytes, dtype=torch.uint8, device=device)
                transport.register(self.recv)
        self.coder = self.make_coder()
        if self.store_scope is not None:
            from turbowire.connector.store_worker import StoreWorker

            self.store = StoreWorker(self.config, self.geometry, self.codec, self.store_scope,
                                     self.tp_rank, self.caches, self.stats, coder=self.coder)
        if transport is None:
            logger.info("turbowire worker tp%d: %d layers registered, store path only",
                        self.tp_rank, len(self.kv_caches))
            return
        if self.is_consumer:
            assert self.recv is not None
            self.recv_ranges = ByteRanges(self.config.recv_bytes)
            self._clients = ClientPool.from_config(self.config)
            local = LocalEnd(
                self.engine_id, self.tp_rank, self.record, self.mem_type, self.recv.data_ptr(),
                max(device.index or 0, 0), self.caches.num_blocks,
                self.caches.dense_bytes_per_token(), self.record.tp_size,
            )
            self.loader = KVLoader(
                self.config, self.geometry, self.layout, self.chunk_nbytes, local, transport,
                self._clients, self.recv_ranges, self.coder.decode, self._executor, self.stats,
                prepare=self.coder.prepare_load,
            )
        self.handshake_metadata = TurboWireHandshakeMetadata(
            agent_name=transport.agent_name,
            agent_metadata=transport.local_metadata(),
            base_addr=self.staging.data_ptr() if self.staging is not None else 0,
            slot_bytes=self.layout.slot_bytes,
            num_slots=self.layout.num_slots,
            layer_offsets=list(self.layout.layer_offsets),
            device_id=max(device.index or 0, 0),
            mem_type=self.mem_type,
            head_groups=self.layout.head_groups,
        )
        # the staging gauges are the scheduler's (it owns the pool; _publish_gauges): a reading
        # from here shared their series and overwrote or was overwritten by the scheduler's
        pool = self.layout.pool_bytes if self.is_producer else 0
        logger.info(
            "turbowire worker tp%d: %d layers registered, staging %d B, recv %d B (%s)",
            self.tp_rank, len(self.kv_caches), pool,
            self.config.recv_bytes if self.is_consumer else 0, self.mem_type,
        )

    def _agent_name(self) -> str:
        """This worker's NIXL agent name, unique per process start. It ended in the low 16 bits
        of ``id(self)`` (16-byte aligned: 4096 values), so an engine restarted under the same
        ``engine_id`` could get its old name back; a decode engine still holding the old
        incarnation's agent then cannot load the new one's metadata (NIXL refuses a second agent
        of a known name: ``NIXL_ERR_NOT_ALLOWED``) and every load from it fails."""
        return f"tw-{self.engine_id[:16]}-tp{self.tp_rank}-{uuid.uuid4().hex[:8]}"

    def chunk_nbytes(self, layer: int, num_tokens: int, block_index: int,
                     heads: int | None = None) -> int:
        """Exact bytes of the chunk of request block ``block_index`` (the first block of a
        sequence carries extra rows, so the size depends on where the block starts); ``heads``:
        a prefill rank's heads per chunk when the engines' TP sizes differ."""
        key = (layer, num_tokens, block_index == 0, heads or 0)
        size = self._sizes.get(key)
        if size is None:
            size = chunk_nbytes(self.codec, self.geometry, layer, num_tokens, block_index, heads)
            self._sizes[key] = size
        return size

    def make_coder(self, kind: Literal["auto", "cuda", "host"] = "auto",
                   kernel_config: Any = "auto") -> CacheCoder:
        """This worker's cache coder over its registered caches and buffers (``kind``: see
        ``coder.make_coder``; tests force the CUDA coder on CPU)."""
        assert self.caches is not None
        return make_coder(self.codec, self.geometry, self.caches, layout=self.layout,
                          staging=self.staging, recv=self.recv, chunk_nbytes=self.chunk_nbytes,
                          save_schedule=self.config.save_schedule, kind=kind,
                          kernel_config=kernel_config)

    # ------------------------------------------------------------------ prefill: encode
    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, meta: TurboWireConnectorMetadata
    ) -> None:
        if not meta.saves or self.staging is None or not self._layerwise:
            return  # after_forward: every layer is encoded in wait_for_save
        layer = self.layer_index.get(layer_name)
        if layer is None or layer in self._saved_layers:
            return
        assert self.coder is not None
        self.coder.save_layer(layer, meta)
        self._saved_layers.add(layer)

    def wait_for_save(self, meta: TurboWireConnectorMetadata | None) -> None:
        """Encode the layers vLLM did not hand over and make the step's bytes final before the
        scheduler publishes them (the CUDA coder: the current stream waits for the encodes, no
        host sync); sizes come from the codec, encode times once they are known."""
        if meta is not None and meta.store_saves and self.store is not None:
            self.store.save(meta.store_saves)
        if meta is None or not meta.saves or self.staging is None:
            self._saved_layers.clear()
            return
        assert self.coder is not None and self.caches is not None
        tokens, wire = self.coder.finish_save(meta)
        self.stats.record_send(P2P_LABEL, self.config.preset,
                               tokens * self.caches.dense_bytes_per_token(), wire)
        for seconds in self.coder.encode_seconds():
            self.stats.observe("encode_seconds", seconds, transport=P2P_LABEL,
                               preset=self.config.preset)
        self._saved_layers.clear()

    # ------------------------------------------------------------------ decode: load
    def start_load_kv(self, meta: TurboWireConnectorMetadata) -> None:
        if self.loader is not None:
            self.loader.start(meta.loads)
        if self.store is not None and meta.store_loads:
            self.store.start_loads(meta.store_loads)

    def get_transfer_results(self) -> tuple[set[str], set[str]]:
        """(finished incl. failed, failed) since the last call. A store load that stopped at a
        bad chunk is finished, not failed: its bad blocks go to ``take_invalid_blocks`` and vLLM
        recomputes from there."""
        finished: set[str] = set()
        failed: set[str] = set()
        if self.loader is not None:
            finished, failed = self.loader.results()
        if self.store is not None:
            finished = finished | self.store.results()
        return finished, failed

    def take_invalid_blocks(self) -> set[int]:
        return self.store.take_invalid_blocks() if self.store is not None else set()

    def take_reports(self) -> TurboWireWorkerMeta | None:
        reports = self.loader.take_reports() if self.loader is not None else {}
        stored: dict[str, int] = {}
        if self.store is not None:
            store_reports, stored = self.store.take_reports()
            reports = {**reports, **store_reports}
        return TurboWireWorkerMeta(reports, stored) if reports or stored else None

    def get_stats(self) -> TurboWireConnectorStats | None:
        if self.stats.is_empty():
            return None
        return self.stats.clone_and_reset()

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.store is not None:
            self.store.close()
        if self.loader is not None:
            self.loader.close()
        if self._clients is not None:
            self._clients.close()
        if self.transport is not None:
            self.transport.close()
            self.transport = None
