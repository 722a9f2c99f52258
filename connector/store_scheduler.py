"""Scheduler side of the store path: lookups before a prompt is computed, saves after.

Lookup (``get_num_new_matched_tokens``): the prompt's full chunks are named by their chained
prefix hash (``turbowire.store.keys``) under the request's key inputs as vLLM's prefix cache keys
them (``cache_salt``, LoRA adapter, multimodal items: ``chain_inputs_of``), so KV is reused only
where vLLM itself would reuse it; a request the keys cannot name (prompt embeddings) neither
looks up nor saves, counted as fallback reason ``store_unsupported_input``. The longest run of
leading chunks that the directory (or this engine's own local tiers, as its workers reported
them) holds becomes external tokens to load, beyond what vLLM's own prefix cache already has.
Nothing is read here but the directory.

Save (``build_connector_meta``): every full chunk of a request (prompt and accepted outputs, so
a later turn can reuse it) that this engine computed (not loaded from the store or a peer) is
planned for encoding in the step whose end makes all its positions verified
(``turbowire.connector.speculative.verified_tokens``: never a draft that may be rejected); the
workers encode it after the forward pass (and the drafter's) and store it without waiting.

Redis down: lookups are misses (counted), the engine keeps serving; the directory's circuit
breaker keeps a dead Redis from slowing the scheduler loop.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from turbowire.connector.config import TurboWireConfig
from turbowire.connector.geometry import blocks_for_tokens
from turbowire.connector.metadata import StoreChunk, StoreLoad, StoreSave
from turbowire.connector.speculative import verified_tokens
from turbowire.connector.stats import TurboWireConnectorStats
from turbowire.errors import TurboWireError, failure_reason
from turbowire.store.keys import (
    NO_INPUTS,
    ChainInputs,
    StoreKeyError,
    StoreScope,
    UnsupportedStoreInput,
    chain_inputs_of,
    chunk_hashes,
    extend_chunk_hashes,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

    from turbowire.connector.compat import CompatibilityRecord
    from turbowire.store.directory import Directory

logger = logging.getLogger(__name__)

OPT_OUT_PARAM = "turbowire_store"
LOCAL_INDEX_MAX = 1 << 20  # chunk hashes remembered as held by this engine's local tiers
RECENT_SAVES_MAX = 1 << 16  # chunk hashes queued for saving recently (no duplicate encodes)
SAVE_PENDING_SECONDS = 30.0  # a planned save not confirmed by then may be planned again
MAX_LOADS_PER_REQUEST = 2  # a load, and one more after a preemption; never a loop of failures
REGISTER_PERIOD_S = 10.0
#: Fallback reason of a request the store keys cannot name (``turbowire_kv_fallbacks_total``).
UNSUPPORTED_REASON = UnsupportedStoreInput.reason


@dataclass
class StoreRequestState:
    """What the store path knows about one request of this engine."""

    request: Request
    hashes: list[bytes]  # the prompt's chunks at lookup; grows with verified outputs
    save: bool
    stored_chunks: int | None = None  # leading chunks found stored (None: not looked up yet)
    local_computed: int = 0  # tokens vLLM's prefix cache had at lookup
    external_tokens: int = 0  # tokens loaded from the store
    next_save: int = 0  # first chunk index not yet planned for saving
    counted: bool = False
    loads: int = 0  # loads queued for this request (a failed one is not retried)
    inputs: ChainInputs = NO_INPUTS  # salt, adapter, multimodal items: part of every hash


@dataclass
class _Recent:
    entries: OrderedDict[bytes, float] = field(default_factory=OrderedDict)

    def add(self, key: bytes, limit: int) -> None:
        self.entries[key] = time.monotonic()
        self.entries.move_to_end(key)
        while len(self.entries) > limit:
            self.entries.popitem(last=False)


class StorePlanner:
    """The store path's scheduler-side state of one engine."""

    def __init__(
        self,
        config: TurboWireConfig,
        scope: StoreScope,
        block_size: int,
        engine_id: str,
        stats: TurboWireConnectorStats,
        block_ids_of: Callable[[str], list[int]],
        directory: Directory | None = None,
    ) -> None:
        self.config = config
        self.scope = scope
        self.chunk_tokens = scope.chunk_tokens
        self.block_size = block_size
        self.engine_id = engine_id
        self.stats = stats
        self._block_ids_of = block_ids_of
        if directory is None and config.directory_url:
            from turbowire.store.directory import Directory

            directory = Directory(config.directory_url, ttl_seconds=config.store_ttl_seconds)
        self.directory = directory
        self._states: dict[str, StoreRequestState] = {}
        self._skipped: set[str] = set()  # requests the store keys cannot name (counted once)
        self._local = _Recent()  # held by this engine's local tiers (workers' reports)
        self._queued = _Recent()  # planned for saving, outcome not known yet
        self._pending_loads: list[StoreLoad] = []
        self._last_register = 0.0

    # ------------------------------------------------------------------ lookup
    def lookup(self, request: Request, num_computed_tokens: int) -> int:
        """External tokens the store can supply beyond ``num_computed_tokens`` (0: none)."""
        state = self._state(request)
        if state is None or not state.hashes:
            return 0
        if state.stored_chunks is None:
            state.stored_chunks = self._stored_prefix(state.hashes)
            state.next_save = state.stored_chunks
        state.local_computed = num_computed_tokens
        if state.loads >= MAX_LOADS_PER_REQUEST:
            return 0  # loaded already and vLLM asks again: compute the rest
        if not state.counted:
            state.counted = True
            covered = max(state.stored_chunks, num_computed_tokens // self.chunk_tokens)
            for _ in range(len(state.hashes) - covered):
                self.stats.record_store(False, 0)
        count = state.stored_chunks * self.chunk_tokens - num_computed_tokens
        if count <= 0 or count < self.config.min_transfer_tokens:
            return 0
        return count

    def _stored_prefix(self, hashes: list[bytes]) -> int:
        local = 0
        while local < len(hashes) and hashes[local] in self._local.entries:
            local += 1
        if self.directory is None or local == len(hashes):
            return local
        try:
            remote = self.directory.longest_prefix(self.scope, hashes)
        except TurboWireError as exc:
            self.stats.record_store_failure("lookup", failure_reason(exc))
            logger.debug("store directory lookup failed: %s", exc)
            return local
        return max(local, min(int(remote), len(hashes)))

    def _state(self, request: Request) -> StoreRequestState | None:
        req_id = request.request_id
        state = self._states.get(req_id)
        if state is not None:
            return state
        if req_id in self._skipped:
            return None
        try:
            inputs = chain_inputs_of(request)
            hashes = chunk_hashes(request.prompt_token_ids, self.chunk_tokens, inputs=inputs)
        except UnsupportedStoreInput as exc:
            self._skip(req_id, f"{exc}; the store is not used for it", UNSUPPORTED_REASON)
            return None
        except StoreKeyError as exc:
            self._skip(req_id, f"{exc}; not looked up or stored", "bad_params")
            return None
        state = StoreRequestState(request, hashes, self._wants_save(request), inputs=inputs)
        self._states[req_id] = state
        return state

    def _skip(self, req_id: str, why: str, reason: str) -> None:
        self._skipped.add(req_id)
        self.stats.record_fallback(reason)
        logger.info("request %s: %s", req_id, why)

    def _wants_save(self, request: Request) -> bool:
        params = request.kv_transfer_params or {}
        value = params.get(OPT_OUT_PARAM, True) if isinstance(params, dict) else True
        if isinstance(value, bool):
            return value
        logger.warning(
            "request %s: kv_transfer_params.%s must be true or false (got %r); not stored",
            request.request_id, OPT_OUT_PARAM, str(value)[:40],
        )
        self.stats.record_failure("bad_params")
        return False

    # ------------------------------------------------------------------ load
    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        """Queue the load of the chunks vLLM allocated blocks for."""
        state = self._states.get(request.request_id)
        if state is None or num_external <= 0 or state.stored_chunks is None:
            return
        first = state.local_computed
        end = first + num_external
        if end > state.stored_chunks * self.chunk_tokens or end % self.chunk_tokens:
            logger.error(
                "request %s: vLLM allocated %d external tokens from %d, store holds %d; "
                "loading nothing", request.request_id, num_external, first,
                state.stored_chunks * self.chunk_tokens,
            )
            return
        block_ids = [b.block_id for b in blocks.blocks[0]]
        if len(block_ids) < blocks_for_tokens(end, self.block_size):
            logger.error(
                "request %s: %d blocks allocated, %d needed; loading nothing",
                request.request_id, len(block_ids), blocks_for_tokens(end, self.block_size),
            )
            return
        state.external_tokens = num_external
        state.loads += 1
        chunks = [
            StoreChunk(i * self.chunk_tokens, state.hashes[i])
            for i in range(first // self.chunk_tokens, end // self.chunk_tokens)
        ]
        self._pending_loads.append(StoreLoad(request.request_id, block_ids, first, chunks))

    def load_failed(self, request_id: str, valid_tokens: int) -> None:
        """A load stopped early: vLLM recomputes from the first bad chunk, so save from there."""
        state = self._states.get(request_id)
        if state is not None:
            first_bad = (state.local_computed + valid_tokens) // self.chunk_tokens
            # vLLM asks again for the failed part: the store no longer offers it
            state.stored_chunks = min(state.stored_chunks or 0, first_bad)
            state.next_save = min(state.next_save, first_bad)
            for chunk_hash in state.hashes[first_bad:]:
                self._local.entries.pop(chunk_hash, None)

    def take_loads(self) -> list[StoreLoad]:
        loads, self._pending_loads = self._pending_loads, []
        return loads

    def track_decode(self, request: Request, loaded_tokens: int) -> None:
        """A request whose prompt came from a prefill peer: save what this engine computes
        itself, from the first chunk the peer did not supply (its outputs, for the next turn)."""
        if request.request_id in self._states:
            return
        state = self._state(request)
        if state is not None:
            state.stored_chunks = 0
            state.counted = True
            state.next_save = max(0, loaded_tokens) // self.chunk_tokens

    def is_store_load(self, request_id: str) -> bool:
        state = self._states.get(request_id)
        return state is not None and state.external_tokens > 0

    # ------------------------------------------------------------------ save
    def plan_saves(
        self, num_scheduled_tokens: dict[str, int], draft_lookahead: int = 0
    ) -> list[StoreSave]:
        """The full chunks all of whose positions are verified once this step ran."""
        saves: list[StoreSave] = []
        for req_id, num_scheduled in num_scheduled_tokens.items():
            state = self._states.get(req_id)
            if state is None or not state.save:
                continue
            request = state.request
            verified = verified_tokens(request, num_scheduled, draft_lookahead)
            full = verified // self.chunk_tokens
            if full <= state.next_save:
                continue
            if full > len(state.hashes):
                extend_chunk_hashes(state.hashes, request.all_token_ids[: full * self.chunk_tokens],
                                    self.chunk_tokens, state.inputs)
                full = min(full, len(state.hashes))
            end = full * self.chunk_tokens
            block_ids = self._block_ids_of(req_id)
            if len(block_ids) < blocks_for_tokens(end, self.block_size):
                # blocks not there (yet): plan nothing now, this step's chunks stay due
                logger.debug("request %s: %d blocks for %d tokens; save deferred",
                             req_id, len(block_ids), end)
                continue
            chunks = []
            for i in range(state.next_save, full):
                chunk_hash = state.hashes[i]
                queued_at = self._queued.entries.get(chunk_hash)
                if chunk_hash in self._local.entries or (
                    queued_at is not None and time.monotonic() - queued_at < SAVE_PENDING_SECONDS
                ):
                    continue  # held already, or another request is saving it right now
                self._queued.add(chunk_hash, RECENT_SAVES_MAX)
                chunks.append(StoreChunk(i * self.chunk_tokens, chunk_hash))
            state.next_save = full
            if chunks:
                last = chunks[-1].token_start + self.chunk_tokens
                needed = blocks_for_tokens(last, self.block_size)
                saves.append(StoreSave(req_id, list(block_ids[:needed]), chunks))
        return saves

    def note_stored(self, stored: dict[str, int]) -> None:
        """Workers stored these chunks in their local tiers (all TP ranks: then it is a hit)."""
        for hex_hash, ranks in stored.items():
            if ranks >= self.scope.tp_size:
                self._local.add(bytes.fromhex(hex_hash), LOCAL_INDEX_MAX)

    # ------------------------------------------------------------------ lifecycle
    def finished(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self._skipped.discard(request_id)

    def maintain(self, role: str, side_channel: str, record: CompatibilityRecord) -> None:
        """Keep this engine's registry entry alive (the proxy learns the store scope from it)."""
        if self.directory is None:
            return
        now = time.monotonic()
        if now - self._last_register < REGISTER_PERIOD_S:
            return
        from turbowire.store.directory import EngineEntry

        entry = EngineEntry(
            engine_id=self.engine_id, role=role, side_channel=side_channel, http_url=None,
            scope=self.scope.to_dict(), record=_record_dict(record), heartbeat=time.time(),
        )
        try:
            self.directory.register_engine(entry, ttl_seconds=3 * REGISTER_PERIOD_S)
        except TurboWireError as exc:
            # retried on the next maintenance tick (the directory's breaker keeps it cheap), so
            # the entry is back within seconds of Redis returning
            logger.debug("store directory registration failed: %s", exc)
            return
        self._last_register = now

    def close(self) -> None:
        if self.directory is not None:
            self.directory.close()


def _record_dict(record: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(record).items()}
