"""Prefill side of the connector's scheduler: what to encode, the staging pool, leases, gauges.

Every step, the blocks of a ``do_remote_decode`` request that became complete (and, when the
prompt is done, the partial last block) get staging slots and an encode order for the worker. A
full pool is back-pressure: the request falls back to local recompute on the decode engine
(``turbowire_fallback``), its slots are returned, and the fallback is counted. When the request
finishes, the dense blocks are freed at once and the slots become a lease, handed to the decode
engine in the signed ``kv_transfer_params``; the side-channel server serves the pool's leases
(claims, heartbeats, releases) to decode engines.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from turbowire.connector.codecs import chunk_nbytes
from turbowire.connector.geometry import (
    block_tag,
    blocks_for_tokens,
    keep_state_blocks,
    tokens_in_block,
)
from turbowire.connector.metadata import SaveBlock, SaveRequest, TurboWireHandshakeMetadata
from turbowire.connector.params import prefill_result, prompt_digest
from turbowire.connector.speculative import truncate_for_prefill
from turbowire.connector.staging import (
    DuplicateLeaseError,
    LeaseAnswer,
    PromptClaim,
    StagingFullError,
    StagingPool,
)
from turbowire.kernels import NO_BLOCK

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from turbowire.connector.config import TurboWireConfig
    from turbowire.connector.spec import EngineSetup
    from turbowire.connector.stats import TurboWireConnectorStats

logger = logging.getLogger(__name__)


@dataclass
class SendState:
    """A prefill request whose KV is being staged."""

    request: Request
    encoded_blocks: int = 0
    fallback: str | None = None
    wire_bytes: int = 0
    dense_bytes: int = 0


class Sender:
    """The prefill role of one engine's scheduler: staging plans, leases and their gauges."""

    def __init__(
        self,
        config: TurboWireConfig,
        setup: EngineSetup,
        *,
        engine_id: str,
        side_channel_port: int,
        stats: TurboWireConnectorStats,
        mac_key: bytes | None,
        block_tables: Callable[[str], list[list[int]]],
    ) -> None:
        self.config = config
        self.engine_id = engine_id
        self.side_channel_port = side_channel_port
        self.stats = stats
        self.is_producer = setup.is_producer
        self.geometry = setup.geometry
        self.block_size = setup.geometry.block_size
        self.codec = setup.codec
        self.layout = setup.layout
        self.tp_size = setup.tp_size
        self.record = setup.record
        self.prefill_backoff = setup.prefill_backoff
        self._mac_key = mac_key
        self._block_tables = block_tables
        share = config.staging_request_share
        self.pool = StagingPool(
            self.layout.num_slots, config.lease_seconds, on_refused=self._lease_refused,
            on_mismatch=self._prompt_mismatch, claim_seconds=config.claim_deadline_seconds,
            max_age_seconds=config.lease_age_cap_seconds,
            max_request_slots=None if share >= 1 else max(1, int(share * self.layout.num_slots)),
        )
        self.sending: dict[str, SendState] = {}
        self.server: Any = None

    # ------------------------------------------------------------------ requests
    def track(self, request: Request) -> None:
        """A ``do_remote_decode`` request arrived: stage its blocks as they are computed."""
        if truncate_for_prefill(request, self.prefill_backoff):
            logger.debug(
                "request %s: the last %d prompt token(s) are left to the decode engine",
                request.request_id, self.prefill_backoff,
            )
        self.sending[request.request_id] = SendState(request)

    def plan_saves(self, num_scheduled_tokens: Mapping[str, int]) -> list[SaveRequest]:
        """This step's encode orders; a request whose planning fails falls back alone."""
        saves: list[SaveRequest] = []
        for req_id, num_scheduled in num_scheduled_tokens.items():
            state = self.sending.get(req_id)
            if state is None or state.fallback is not None:
                continue
            try:
                save = self.plan_save(state, num_scheduled)
            except Exception:  # noqa: BLE001 - one request falls back, the step goes on
                logger.exception(
                    "turbowire: staging request %s failed; the decode engine recomputes "
                    "its prompt", req_id,
                )
                self.pool.drop(req_id)
                state.fallback = "internal"
                self.stats.record_failure("internal")
                continue
            if save is not None:
                saves.append(save)
        return saves

    def plan_save(self, state: SendState, num_scheduled: int) -> SaveRequest | None:
        """Slots and encode orders for the blocks of ``state`` complete after this step."""
        request = state.request
        prompt_len = request.num_prompt_tokens
        computed_after = request.num_computed_tokens + num_scheduled
        if computed_after >= prompt_len:
            target_blocks = blocks_for_tokens(prompt_len, self.block_size)
        else:
            target_blocks = computed_after // self.block_size
        new = range(state.encoded_blocks, target_blocks)
        if not new:
            return None
        try:
            slots = self.pool.reserve(request.request_id, len(new))
        except StagingFullError as exc:  # the pool is full, or the request's share of it
            logger.warning(
                "request %s: %s; the decode engine recomputes its prompt", request.request_id, exc
            )
            self.pool.drop(request.request_id)
            state.fallback = exc.reason
            self.stats.record_fallback(exc.reason)
            return None
        except DuplicateLeaseError as exc:  # a repeated request id: the first one keeps its lease
            logger.warning(
                "request %s: %s; this one is not staged (the decode engine recomputes it)",
                request.request_id, exc,
            )
            self.pool.drop(request.request_id)
            state.fallback = "internal"
            self.stats.record_failure("internal")
            return None
        # a state layer moves the state at the prompt's end, staged in the step that computes it
        tables = keep_state_blocks(self._block_tables(request.request_id),
                                   self.geometry.state_groups, target_blocks,
                                   final=computed_after >= prompt_len)
        block_ids = tables[0]
        blocks = []
        for i, slot in zip(new, slots, strict=True):
            n = tokens_in_block(i, prompt_len, self.block_size)
            blocks.append(
                SaveBlock(
                    index=i,
                    block_id=block_ids[i],
                    num_tokens=n,
                    slot=slot,
                    tag=block_tag(request.request_id, i),
                )
            )
            state.wire_bytes += sum(
                chunk_nbytes(self.codec, self.geometry, layer, n, i)
                for layer, spec in enumerate(self.geometry.layers)
                if not spec.is_state or tables[spec.group][i] != NO_BLOCK
            )
            state.dense_bytes += n * self.geometry.dense_bytes_per_token(self._element_size())
        state.encoded_blocks = target_blocks
        self.publish_gauges()
        return SaveRequest(
            request.request_id, list(block_ids[:target_blocks]), blocks,
            group_tables=[list(t[:target_blocks]) for t in tables] if len(tables) > 1 else [],
        )

    def finish(self, req_id: str) -> tuple[bool, dict[str, Any] | None]:
        """Whether ``req_id`` was a staged request and, if so, the params for its decode
        engine (a lease, or the fallback that tells it to recompute)."""
        state = self.sending.pop(req_id, None)
        if state is None:
            return False, None
        return True, self._finish_send(state)

    def forget(self, req_id: str) -> None:
        """Drop a request's staging state and reserved slots (a lease handed on stays)."""
        self.sending.pop(req_id, None)
        self.pool.drop(req_id)

    def _finish_send(self, state: SendState) -> dict[str, Any] | None:
        from vllm.v1.request import RequestStatus

        request = state.request
        req_id = request.request_id
        if request.status not in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH_CAPPED,
        ):
            self.pool.drop(req_id)
            self.publish_gauges()
            return None
        expected_blocks = blocks_for_tokens(request.num_prompt_tokens, self.block_size)
        if state.fallback is None and state.encoded_blocks != expected_blocks:
            state.fallback = "incomplete"
            self.stats.record_fallback("incomplete")
            logger.warning(
                "request %s finished with %d of %d blocks staged", req_id,
                state.encoded_blocks, expected_blocks,
            )
        common = dict(
            engine_id=self.engine_id,
            request_id=req_id,
            host=self.config.side_channel_host,
            port=self.side_channel_port,
            tp_size=self.tp_size,
            preset=self.config.preset,
            format_version=self.record.format_version,
            lease_seconds=self.config.lease_seconds,
            mac_key=self._mac_key,
        )
        num_tokens = request.num_prompt_tokens
        digest = None
        lease = None
        if state.fallback is None:
            prompt = request.prompt_token_ids or []
            digest = prompt_digest(prompt, num_tokens) if prompt else None
            try:  # bound to the prompt staged: a claim presenting another is refused
                lease = self.pool.lease(req_id, state.wire_bytes, consumers=self.tp_size,
                                        prompt_digest=digest, num_tokens=num_tokens)
            except DuplicateLeaseError as exc:
                logger.warning("request %s: %s; not handed to a decode engine", req_id, exc)
                state.fallback = "internal"
                self.stats.record_failure("internal")
        if state.fallback is not None:
            self.pool.drop(req_id)
            self.publish_gauges()
            return prefill_result(
                **common, slots=[], num_tokens=0, prompt_hash=None, dense_bytes=0,
                wire_bytes=0, fallback=state.fallback,
            )
        assert lease is not None
        self.publish_gauges()
        return prefill_result(
            **common,
            slots=lease.slots,
            num_tokens=num_tokens,
            prompt_hash=digest,
            dense_bytes=state.dense_bytes,
            wire_bytes=state.wire_bytes,
            lease_token=lease.token,
        )

    def _element_size(self) -> int:
        import torch

        return torch.empty((), dtype=getattr(torch, self.geometry.dtype)).element_size()

    # ------------------------------------------------------------------ leases
    def reap(self) -> None:
        """Expire the leases no decode engine claimed or heartbeated in time (counted)."""
        expired = self.pool.reap()
        for _ in expired:
            self.stats.record_failure("lease_expired")
        if expired:
            self.publish_gauges()

    def _lease_refused(self, missing: list[str], wrong: list[str]) -> None:
        """Side-channel calls that named a lease without its token (gRPC threads): counted once
        per lease, ``incompatible`` without a token (a decode engine of transfer format 1),
        ``lease_refused`` with a wrong one (forged or altered kv_transfer_params; the decode
        engine whose claim was refused counts the same reason)."""
        for _ in missing:
            self.stats.record_failure("incompatible")
        for _ in wrong:
            self.stats.record_failure("lease_refused")

    def _prompt_mismatch(self, ids: list[str]) -> None:
        """Claims (gRPC threads) that presented another prompt than the lease's: params of one
        prompt sent with another. Counted once per lease; the decode engine counts its failed
        load by the same reason."""
        for _ in ids:
            self.stats.record_failure("prompt_mismatch")

    def gauge_values(self) -> tuple[int, int]:
        """(staging bytes in use, leases outstanding) of the pool right now. Every TP worker
        holds a staging pool of the same slots, so the bytes are summed over the workers."""
        snap = self.pool.snapshot()
        return snap.used_slots * self.layout.slot_bytes * self.tp_size, snap.leases

    def publish_gauges(self) -> None:
        """The staging gauges, all three owned by the scheduler (the workers set none): they
        share one ``worker`` label, and vLLM merges worker and scheduler stats of a step by
        overwriting the same series, so a second owner's reading made the exported value depend
        on which side reported last (a decode-only engine exported the capacity of a staging
        pool it never allocated)."""
        in_use, leases = self.gauge_values()
        capacity = self.layout.pool_bytes * self.tp_size if self.is_producer else 0
        self.stats.set_gauge("staging_bytes_in_use", in_use)
        self.stats.set_gauge("staging_capacity_bytes", capacity)
        self.stats.set_gauge("leases_outstanding", leases)

    # ------------------------------------------------------------------ side channel
    def serve(self, metadata: Mapping[tuple[int, int], Any]) -> None:
        """Workers registered their staging pools: serve them on the side channel (once)."""
        from turbowire.connector.sidechannel.convert import StagingInfo
        from turbowire.connector.sidechannel.server import SideChannelServer, SideChannelTLS

        staging: dict[int, StagingInfo] = {}
        for (pp_rank, tp_rank), meta in metadata.items():
            if pp_rank != 0:
                raise ValueError("turbowire does not support pipeline-parallel KV transfer yet")
            if not isinstance(meta, TurboWireHandshakeMetadata):
                raise TypeError(f"unexpected handshake metadata {type(meta).__name__}")
            staging[tp_rank] = StagingInfo(
                agent_name=meta.agent_name,
                agent_metadata=meta.agent_metadata,
                base_addr=meta.base_addr,
                slot_bytes=meta.slot_bytes,
                num_slots=meta.num_slots,
                layer_offsets=tuple(meta.layer_offsets),
                device_id=meta.device_id,
                mem_type=meta.mem_type,
                head_groups=meta.head_groups,
            )
            if meta.slot_bytes != self.layout.slot_bytes or meta.num_slots != self.layout.num_slots:
                raise RuntimeError(
                    "worker staging layout differs from the scheduler's "
                    f"({meta.num_slots}x{meta.slot_bytes} vs "
                    f"{self.layout.num_slots}x{self.layout.slot_bytes})"
                )
        if self.server is None and staging and self.is_producer:
            self.server = SideChannelServer(
                engine_id=self.engine_id,
                record=self.record,
                staging=staging,
                leases=GaugedLeases(self),
                bind_host=self.config.side_channel_bind,
                port=self.side_channel_port,
                auth_token=self.config.auth_token,
                tls=SideChannelTLS.from_config(self.config),
            ).start()

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


class GaugedLeases:
    """The pool as the side channel sees it (its ``LeaseHandler``): the staging gauges follow
    the releases decode engines make from gRPC threads."""

    def __init__(self, sender: Sender) -> None:
        self._sender = sender

    def release(
        self, request_ids: Sequence[str], consumer: int, tokens: Sequence[str],
        consumers: int = 0,
    ) -> LeaseAnswer:
        result = self._sender.pool.release(request_ids, consumer, tokens, consumers)
        self._sender.publish_gauges()
        return result

    def heartbeat(
        self, request_ids: Sequence[str], tokens: Sequence[str],
        prompts: Sequence[PromptClaim] | None = None, consumers: int = 0,
    ) -> LeaseAnswer:
        return self._sender.pool.heartbeat(request_ids, tokens, prompts, consumers)

    def snapshot(self) -> Any:
        return self._sender.pool.snapshot()
