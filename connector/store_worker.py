"""Worker side of the store path: encode computed chunks into the store, load stored ones.

Save: after the forward pass (``wait_for_save``) each planned chunk is encoded once, every layer
with the worker's cache coder and the NIXL path's wire format, into one blob
(``turbowire.store.blob``): the CUDA coder encodes every chunk of a step in one plan on a side
stream and a background thread waits for the copy to host memory, so the engine thread never
waits for the device; the host coder encodes chunk by chunk. The write to LMCache's tiers runs
in the background, and only a write that finished is published in the directory, so a
directory hit means the bytes were there.

Load: the chunks of a request are fetched a few at a time and decoded in order, each as soon as
it has arrived and passed every check (blob header: prefix hash, tokens, rank, layer sizes; each
layer chunk's checksums, preset, geometry and tag). The first chunk that is missing or fails a
check ends the load: its blocks and everything after them are reported to vLLM as load errors
(``get_block_ids_with_load_errors``), so vLLM recomputes from there; nothing of it is decoded.
A chunk that failed its checks is also removed from the tiers (puts never overwrite, so a later
save could not replace it otherwise). The directory entries of the chunks a load used are
refreshed then (lookups never refresh them: only real use keeps a chunk alive).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from turbowire.connector import probe
from turbowire.connector.coder import BlobPlan, CacheCoder, EncodedBlobs, make_coder
from turbowire.connector.coder.host import wait_for_device
from turbowire.connector.config import TurboWireConfig
from turbowire.connector.geometry import KVGeometry, blocks_for_tokens
from turbowire.connector.metadata import LoadReport, StoreChunk, StoreLoad, StoreSave
from turbowire.connector.stats import STORE_LABEL, TurboWireConnectorStats
from turbowire.errors import TurboWireError, failure_reason
from turbowire.store.blob import BlobHeader, check_expected, header_nbytes, parse_header
from turbowire.store.keys import StoreScope, chunk_tag

if TYPE_CHECKING:
    from turbowire.codec import Codec
    from turbowire.connector.caches import EngineCaches
    from turbowire.store.directory import Directory
    from turbowire.store.tiers import ChunkStore

logger = logging.getLogger(__name__)

FETCHES_IN_FLIGHT = 4  # chunk reads of one load on the way while the one that arrived decodes


class StoreMiss(TurboWireError):
    """A chunk the directory listed is not in the store (evicted, expired, Redis down)."""

    reason = "store_miss"


class StoreWorker:
    """One worker's (TP rank's) store path."""

    def __init__(
        self,
        config: TurboWireConfig,
        geometry: KVGeometry,
        codec: Codec,
        scope: StoreScope,
        tp_rank: int,
        caches: EngineCaches,
        stats: TurboWireConnectorStats,
        store: ChunkStore | None = None,
        directory: Directory | None = None,
        coder: CacheCoder | None = None,
    ) -> None:
        self.config = config
        self.geometry = geometry
        self.codec = codec
        self.scope = scope
        self.rank = tp_rank
        self.caches = caches
        self.stats = stats
        # the worker's coder (one per worker, shared with the P2P path); standalone: its own
        self.coder = coder if coder is not None else make_coder(codec, geometry, caches)
        self._layer_sizes: dict[int, list[int]] = {}
        if store is None:
            from turbowire.store.tiers import ChunkStore, StoreSettings

            store = ChunkStore(StoreSettings(
                store_url=config.store_url,
                local_cpu_bytes=config.store_local_cpu_bytes,
                local_disk=config.store_local_disk,
                ttl_seconds=config.store_ttl_seconds,
                namespace=config.store_namespace,
                max_object_bytes=self.max_blob_nbytes(),
            ))
        self.store = store
        if directory is None and config.directory_url:
            from turbowire.store.directory import Directory

            directory = Directory(config.directory_url, ttl_seconds=config.store_ttl_seconds)
        self.directory = directory
        self._lock = threading.Lock()
        self._finished: set[str] = set()
        self._invalid_blocks: set[int] = set()
        self._reports: dict[str, LoadReport] = {}
        self._stored: dict[str, int] = {}
        self._loads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tw-store-load")
        self._fetches = ThreadPoolExecutor(max_workers=FETCHES_IN_FLIGHT,
                                           thread_name_prefix="tw-store-fetch")
        self._copies: ThreadPoolExecutor | None = None  # stores the coder's background blobs

    # ------------------------------------------------------------------ geometry
    def layer_nbytes(self, token_start: int) -> list[int]:
        """Exact bytes of each layer's codec chunk of a stored chunk starting at token_start
        (the first chunk of a sequence carries the sink rows, so it is larger)."""
        key = 0 if token_start == 0 else 1
        sizes = self._layer_sizes.get(key)
        if sizes is None:
            sizes = [self._layer_chunk_nbytes(layer, token_start)
                     for layer in range(self.geometry.num_layers)]
            self._layer_sizes[key] = sizes
        return sizes

    def _layer_chunk_nbytes(self, layer: int, token_start: int) -> int:
        """A K/V layer's chunk, or an MLA layer's latent chunk (the same rows on every rank)."""
        spec, tokens = self.geometry.layers[layer], self.scope.chunk_tokens
        if spec.is_latent:
            from turbowire.codec.latent import latent_nbytes

            return latent_nbytes(self.codec, layer, tokens, spec.latent_dim, spec.rope_dim,
                                 token_start)
        return int(self.codec.encoded_nbytes(layer, tokens, spec.num_kv_heads, token_start))

    def max_blob_nbytes(self) -> int:
        """The largest blob this worker stores or loads (the first chunk of a sequence, which
        carries the sink rows, or any later one): the bound on what a Redis read may return."""
        layers = self.geometry.num_layers
        return header_nbytes(layers) + max(sum(self.layer_nbytes(0)),
                                           sum(self.layer_nbytes(self.scope.chunk_tokens)))

    def _header(self, chunk: StoreChunk) -> BlobHeader:
        return BlobHeader(
            num_layers=self.geometry.num_layers, rank=self.rank, tp_size=self.scope.tp_size,
            token_start=chunk.token_start, num_tokens=self.scope.chunk_tokens,
            chunk_hash=chunk.chunk_hash, layer_nbytes=tuple(self.layer_nbytes(chunk.token_start)),
        )

    # ------------------------------------------------------------------ save
    def save(self, saves: list[StoreSave]) -> None:
        """Encode the planned chunks now (after the forward pass); store them in the background
        (the coder's blobs still on the device: a thread waits for them; else stored now)."""
        chunks: list[tuple[str, StoreChunk, BlobHeader]] = []
        request: list[int] = []
        for r, save in enumerate(saves):
            for chunk in save.chunks:
                chunks.append((save.request_id, chunk, self._header(chunk)))
                request.append(r)
        if not chunks:
            return
        t0 = time.perf_counter()
        plan = BlobPlan(
            block_ids=[s.block_ids for s in saves], request=request,
            token_start=[c.token_start for _r, c, _h in chunks],
            num_tokens=self.scope.chunk_tokens,
            tags=[chunk_tag(c.chunk_hash) for _r, c, _h in chunks],
            layer_offsets=[list(h.layer_offsets()) for _r, _c, h in chunks],
            layer_nbytes=[list(h.layer_nbytes) for _r, _c, h in chunks],
            blob_nbytes=[h.total_nbytes for _r, _c, h in chunks])
        with probe.mark("store.save"):
            encoded = self.coder.encode_chunks(plan)
        if not encoded.background:
            self._store(chunks, encoded, t0)
            return
        if self._copies is None:
            self._copies = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tw-store-d2h")
        self._copies.submit(self._store, chunks, encoded, t0)

    def _store(self, chunks: list[tuple[str, StoreChunk, BlobHeader]], encoded: EncodedBlobs,
               t0: float) -> None:
        """Put each encoded blob (its header written in) into the store; a chunk the coder
        refused is counted and skipped."""
        try:
            results = encoded.wait()
        except Exception as exc:  # noqa: BLE001 - a thread: log and count, never lose
            logger.exception("the blobs of a step were not stored")
            self.stats.record_store_failure("save", failure_reason(exc))
            return
        for (request_id, chunk, header), (data, encode_s) in zip(chunks, results, strict=True):
            if isinstance(data, BaseException):
                logger.warning("request %s: chunk at token %d not stored: %s", request_id,
                               chunk.token_start, data)
                self.stats.record_store_failure("save", failure_reason(data))
                continue
            try:
                head = header.pack()
                blob = bytearray(data)
                blob[:len(head)] = head
                self._put(chunk, bytes(blob), t0, encode_s)
            except Exception as exc:  # noqa: BLE001 - a thread: log and count, never lose
                logger.exception("chunk at token %d not stored", chunk.token_start)
                self.stats.record_store_failure("save", failure_reason(exc))

    def _put(self, chunk: StoreChunk, data: bytes, t0: float, encode_s: float) -> None:
        nbytes = len(data)

        def done(ok: bool, reason: str | None) -> None:
            if not ok:
                self.stats.record_store_failure("save", reason or "store_unavailable")
                return
            self.stats.record_stored(nbytes)
            self.stats.observe("store_save_seconds", time.perf_counter() - t0,
                               transport=STORE_LABEL, preset=self.config.preset)
            with self._lock:
                key = chunk.chunk_hash.hex()
                self._stored[key] = self._stored.get(key, 0) + 1
            if self.directory is not None:
                try:
                    self.directory.publish(self.scope, [(chunk.chunk_hash, self.rank, nbytes)])
                except TurboWireError as exc:
                    self.stats.record_store_failure("save", failure_reason(exc))

        if not self.store.put(self.scope, chunk.chunk_hash, self.rank, data, on_done=done):
            self.stats.record_store_failure("save", "store_full")
        self.stats.observe("encode_seconds", encode_s, transport=STORE_LABEL,
                           preset=self.config.preset)

    # ------------------------------------------------------------------ load
    def start_loads(self, loads: list[StoreLoad]) -> None:
        for load in loads:
            self._loads.submit(self._run_load, load)

    def _fetch(self, chunk: StoreChunk) -> bytes | None:
        return self.store.get(self.scope, chunk.chunk_hash, self.rank)

    def _run_load(self, load: StoreLoad) -> None:
        t0 = time.perf_counter()
        report = LoadReport(source="store")
        per_token = self.caches.dense_bytes_per_token()
        pending: list[Future] = [self._fetches.submit(self._fetch, c)
                                 for c in load.chunks[:FETCHES_IN_FLIGHT]]
        next_fetch = len(pending)
        failed_at: int | None = None
        try:
            for i, chunk in enumerate(load.chunks):
                blob = pending[i].result()
                if next_fetch < len(load.chunks):
                    pending.append(self._fetches.submit(self._fetch, load.chunks[next_fetch]))
                    next_fetch += 1
                try:
                    if blob is None:
                        raise StoreMiss(f"chunk at token {chunk.token_start} is not in the store")
                    d0 = time.perf_counter()
                    written = self.decode_chunk(load, chunk, blob)
                    report.decode_seconds += time.perf_counter() - d0
                except TurboWireError as exc:
                    failed_at = i
                    reason = failure_reason(exc)
                    report.failed = reason
                    logger.warning("request %s: stored chunk at token %d unusable (%s: %s); "
                                   "recomputing from there", load.request_id, chunk.token_start,
                                   reason, exc)
                    self.stats.record_store(False, 0)
                    self.stats.record_store_failure("load", reason)
                    if blob is not None:  # there but wrong: let a later save replace it
                        self._discard(chunk)
                    self._forget(load.chunks[i:])
                    break
                self.stats.record_store(True, len(blob))
                report.tokens += written
                report.wire_bytes += len(blob)
                report.dense_bytes += written * per_token
        except Exception:  # noqa: BLE001 - a bug must become a recompute, not a hung request
            logger.exception("request %s: store load failed", load.request_id)
            failed_at = failed_at if failed_at is not None else 0
            report.failed = report.failed or "internal"
        finally:
            for future in pending:
                future.cancel()
        wait_for_device(self.caches.device)
        report.transfer_seconds = time.perf_counter() - t0
        used = load.chunks if failed_at is None else load.chunks[:failed_at]
        if used:
            self._touch(used)
        if failed_at is None:
            self.stats.record_recv(STORE_LABEL, self.config.preset, report.dense_bytes,
                                   report.wire_bytes)
            self.stats.observe("store_load_seconds", report.transfer_seconds,
                               transport=STORE_LABEL, preset=self.config.preset)
            self.stats.observe("decode_seconds", report.decode_seconds,
                               transport=STORE_LABEL, preset=self.config.preset)
        with self._lock:
            if failed_at is not None:
                bad_from = max(load.first_token, load.chunks[failed_at].token_start)
                end = load.chunks[-1].token_start + self.scope.chunk_tokens
                first_block = bad_from // self.geometry.block_size
                last_block = blocks_for_tokens(end, self.geometry.block_size)
                self._invalid_blocks.update(load.block_ids[first_block:last_block])
            self._reports[load.request_id] = report
            self._finished.add(load.request_id)

    def decode_chunk(self, load: StoreLoad, chunk: StoreChunk, blob: bytes) -> int:
        """Check and decode one stored chunk of ``load`` (``blob``: what the store returned for
        it); the tokens written (all but those vLLM holds). A blob that fails a check raises a
        ``TurboWireError`` before any layer is written."""
        from turbowire.codec.latent import check_latent_chunk
        from turbowire.codec.wire import parse_header as parse_chunk_header
        from turbowire.codec.wire import verify_body

        header = parse_header(blob)
        check_expected(header, chunk_hash=chunk.chunk_hash, token_start=chunk.token_start,
                       num_tokens=self.scope.chunk_tokens, rank=self.rank,
                       tp_size=self.scope.tp_size,
                       layer_nbytes=self.layer_nbytes(chunk.token_start))
        source = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        tag = chunk_tag(chunk.chunk_hash)
        offsets = header.layer_offsets()
        layer_chunks = list(zip(offsets, header.layer_nbytes, strict=True))
        for layer, (off, size) in enumerate(layer_chunks):
            data = source[off: off + size]  # every layer verified before any is written
            spec = self.geometry.layers[layer]
            if spec.is_latent:
                check_latent_chunk(self.codec, layer, data, spec.latent_dim, spec.rope_dim,
                                   expected_tag=tag, expected_tokens=self.scope.chunk_tokens,
                                   expected_offset=chunk.token_start)
                continue
            chunk_header = parse_chunk_header(data)
            self.codec.check_compatible(chunk_header, layer, tag, self.scope.chunk_tokens,
                                        chunk.token_start)
            verify_body(chunk_header, data)
        return self.coder.decode_chunks(load.block_ids, chunk.token_start,
                                        self.scope.chunk_tokens, layer_chunks, tag, source,
                                        load.first_token - chunk.token_start)

    def _discard(self, chunk: StoreChunk) -> None:
        try:
            self.store.discard(self.scope, chunk.chunk_hash, self.rank)
        except Exception as exc:  # noqa: BLE001 - best effort: it expires anyway
            logger.debug("discarding a bad chunk: %s", exc)

    def _touch(self, chunks: list[StoreChunk]) -> None:
        """Keep the directory entries of chunks this load used alive (only real loads do)."""
        if self.directory is None or self.rank != 0:  # one refresh per engine, not per rank
            return
        try:
            self.directory.touch(self.scope, [c.chunk_hash for c in chunks])
        except Exception as exc:  # noqa: BLE001 - a refresh never fails the load
            logger.debug("refreshing the directory entries of a load: %s", exc)

    def _forget(self, chunks: list[StoreChunk]) -> None:
        if self.directory is None:
            return
        try:
            self.directory.forget(self.scope, [c.chunk_hash for c in chunks[:1]])
        except TurboWireError:
            pass  # the directory is down: its entries expire

    # ------------------------------------------------------------------ results
    def results(self) -> set[str]:
        with self._lock:
            done, self._finished = self._finished, set()
        return done

    def take_invalid_blocks(self) -> set[int]:
        with self._lock:
            blocks, self._invalid_blocks = self._invalid_blocks, set()
        return blocks

    def take_reports(self) -> tuple[dict[str, LoadReport], dict[str, int]]:
        with self._lock:
            reports, self._reports = self._reports, {}
            stored, self._stored = self._stored, {}
        return reports, stored

    def close(self) -> None:
        if self._copies is not None:
            self._copies.shutdown(wait=True)  # stored blobs already on their way
        self._loads.shutdown(wait=False, cancel_futures=True)
        self._fetches.shutdown(wait=False, cancel_futures=True)
        self.store.close()
        if self.directory is not None:
            self.directory.close()
