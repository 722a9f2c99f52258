"""Decode side of the connector's scheduler: params, declines, the load queue, heartbeats.

A ``do_remote_prefill`` request's params are validated once (``parse``): the remote tokens are
announced to vLLM (async load), and once vLLM allocated blocks the load goes to the workers.
Heartbeats (``receiver_heartbeats``) keep the prefill lease alive while the request waits; load
reports from the workers are returned in the finished request's params.

What the params name is not trusted: with an ``auth_token`` their MAC (``turbowire_params_mac``)
must verify, and with ``prefill_peers`` their host must be listed, before anything is dialed (a
heartbeat, a handshake, a release); the claim and every heartbeat present this engine's own
prompt, which the prefill engine compares with the one it staged.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from turbowire.connector.geometry import (
    block_tag,
    blocks_for_tokens,
    keep_state_blocks,
    tokens_in_block,
)
from turbowire.connector.metadata import LoadBlock, LoadReport, LoadRequest, PeerAddress
from turbowire.connector.params import (
    PeerNotAllowedError,
    RemotePrefill,
    TransferParamsError,
    prompt_digest,
)
from turbowire.connector.peers import PeerAllowlist
from turbowire.connector.receiver_heartbeats import Heartbeats, HeartbeatTarget
from turbowire.connector.speculative import remote_prefill_tokens
from turbowire.connector.staging import PromptClaim
from turbowire.connector.tp_plan import peer_refusal
from turbowire.kernels import NO_BLOCK

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

    from turbowire.connector.compat import CompatibilityRecord
    from turbowire.connector.config import TurboWireConfig
    from turbowire.connector.stats import TurboWireConnectorStats

logger = logging.getLogger(__name__)

MAX_LET_GO = 65536  # remembered released leases (a few MiB at most)


class Receiver(Heartbeats):
    """The decode role of one engine's scheduler: what to load, from whom, and the heartbeats
    that keep the prefill engines' leases while the loads wait."""

    def __init__(
        self,
        config: TurboWireConfig,
        *,
        engine_id: str,
        block_size: int,
        record: CompatibilityRecord,
        tp_size: int,
        prefill_backoff: int,
        stats: TurboWireConnectorStats,
        mac_key: bytes | None,
        state_groups: frozenset[int] = frozenset(),
    ) -> None:
        self.config = config
        self.engine_id = engine_id
        self.block_size = block_size
        self.state_groups = state_groups  # groups of a hybrid model's state layers
        self.record = record
        self.tp_size = tp_size
        self.prefill_backoff = prefill_backoff
        self.stats = stats
        self._mac_key = mac_key
        self._allowlist = PeerAllowlist.parse(config.prefill_peers)
        self.pending_loads: list[LoadRequest] = []
        # (prefill engine, remote request id) of the leases this engine's loads already let go
        # (loaded or released): vLLM's cleanup request for the same request sends no second one
        self._let_go: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.load_queued: set[str] = set()
        self.parsed: dict[str, RemotePrefill | None] = {}
        self.reports: dict[str, LoadReport] = {}
        self.heartbeats: dict[str, HeartbeatTarget] = {}
        self._hb_lock = threading.Lock()
        self._hb_inflight: set[tuple[str, int]] = set()  # peers with a heartbeat on the wire
        self._hb_lanes: Any = None  # PeerExecutors: heartbeats to each peer on its own thread
        self.clients: Any = None

    # ------------------------------------------------------------------ requests
    def track(self, request: Request) -> None:
        """A ``do_remote_prefill`` request arrived: heartbeat its lease while it waits."""
        if is_cleanup(request):
            return  # nothing to load or heartbeat: request_finished queues the release
        remote = self.parse(request)
        if remote is None or not remote.slots:
            return
        self.start_heartbeat(request.request_id, remote, self._claim_prompt(request, remote))

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Remote prompt tokens beyond the local prefix hit; side-effect free (cached parse)."""
        if is_cleanup(request) or request.request_id in self.load_queued:
            return 0, False
        remote = self.parse(request)
        if remote is None or remote.num_tokens == 0:
            return 0, False
        count = self.remote_total(remote, request) - num_computed_tokens
        if count <= 0 or count < self.config.min_transfer_tokens:
            return 0, False
        return count, True

    def queue_load(
        self, request: Request, remote: RemotePrefill, blocks: KVCacheBlocks,
        num_external_tokens: int,
    ) -> None:
        """vLLM allocated ``request``'s blocks: load the remote tokens into them (or, with none
        to load, only let the prefill engine's lease go)."""
        req_id = request.request_id
        self.load_queued.add(req_id)
        peer = _peer(remote)
        if num_external_tokens <= 0:
            if remote.slots:  # full local hit (or declined): only let the prefill engine go
                self._queue(_load_request(req_id, remote, peer, []))
            return
        claim = self._claim_prompt(request, remote)
        total = self.remote_total(remote, request)
        first_token = total - num_external_tokens
        first_block = first_token // self.block_size
        last_block = blocks_for_tokens(total, self.block_size)
        groups = blocks.blocks
        # a state group holds one block per request (vLLM's mamba cache mode 'none') or one
        # per block of tokens ('align'): its last one is the state's, whatever the count
        allocated = min(len(group) for g, group in enumerate(groups)
                        if g not in self.state_groups)
        if allocated < last_block:
            logger.error(
                "request %s: %d local blocks allocated, %d needed; loading nothing",
                req_id, allocated, last_block,
            )
            self._queue(_load_request(req_id, remote, peer, []))
            return
        tables = [[NO_BLOCK if b.is_null else b.block_id
                   for b in (group if g in self.state_groups else group[:last_block])]
                  for g, group in enumerate(groups)]
        # a state layer's state after the loaded tokens goes into the group's last block
        tables = keep_state_blocks(tables, self.state_groups, last_block)
        load_blocks = [
            LoadBlock(
                index=i,
                block_id=tables[0][i],
                num_tokens=tokens_in_block(i, total, self.block_size),
                slot=remote.slots[i],
                tag=block_tag(remote.request_id, i),
            )
            for i in range(first_block, last_block)
            # a sliding window's blocks vLLM freed (its null block in the table) are never
            # read; with several groups a block moves for the groups that still hold it
            if any(table[i] != NO_BLOCK for table in tables)
        ]
        load = _load_request(req_id, remote, peer, load_blocks, tables[0], prompt=claim)
        if len(tables) > 1:
            load.group_tables = tables
        self._queue(load)

    def finished(self, request: Request, drafts: Any) -> dict[str, Any] | None:
        """The finished request's params (its load report), after queueing the release of a
        lease no load let go (aborted before it was scheduled, or its params were refused)."""
        req_id = request.request_id
        self.stop_heartbeat(req_id)
        if req_id not in self.load_queued:
            # The cached parse is reused (a fresh one would count a refusal twice), then dropped.
            self._queue_release_only(request)
        self.parsed.pop(req_id, None)
        self.load_queued.discard(req_id)
        report = self.reports.pop(req_id, None)
        if report is not None:
            return {"turbowire_load": with_drafts(report.as_params(), drafts)}
        return None

    def fail_load(self, req_id: str, preset: str) -> None:
        """The load announced for ``req_id`` could not be planned: the workers report it
        failed at once."""
        remote = self.parsed.get(req_id)
        if remote is not None:
            load = _load_request(req_id, remote, _peer(remote), [])
        else:
            load = LoadRequest(req_id, "", PeerAddress("", "", 0, 1), [], preset)
        load.fail_reason = "internal"
        self.load_queued.add(req_id)
        self.stop_heartbeat(req_id)
        self._queue(load)

    def forget(self, req_id: str, finished: bool) -> None:
        """Drop a request's heartbeats and report; its params count as refused from now on."""
        self.stop_heartbeat(req_id)
        self.load_queued.discard(req_id)
        self.reports.pop(req_id, None)
        if finished:
            self.parsed.pop(req_id, None)
        else:
            self.parsed[req_id] = None

    def take_loads(self) -> list[LoadRequest]:
        loads, self.pending_loads = self.pending_loads, []
        return loads

    def remote_total(self, remote: RemotePrefill, request: Request) -> int:
        """Prompt tokens loaded from the peer: never the backoff a drafter needs recomputed."""
        cap = remote_prefill_tokens(request.num_prompt_tokens, self.prefill_backoff)
        return min(remote.num_tokens, cap)

    # ------------------------------------------------------------------ params
    def parse(self, request: Request) -> RemotePrefill | None:
        """Validate a decode request's params once; malformed ones are logged and recomputed."""
        req_id = request.request_id
        if req_id in self.parsed:
            return self.parsed[req_id]
        params = request.kv_transfer_params or {}
        remote: RemotePrefill | None
        try:
            remote = RemotePrefill.parse(params, self.block_size)
            self._authenticate(remote)
        except TransferParamsError as exc:
            logger.error("request %s: %s; its prompt is recomputed locally", req_id, exc)
            self.stats.record_failure(exc.reason)
            remote = None
        else:
            problem = self._decline_reason(request, remote)
            if problem is not None:
                reason, message = problem
                logger.warning("request %s: %s; its prompt is recomputed locally", req_id, message)
                if reason == "fallback":
                    self.stats.record_fallback(remote.fallback or "unknown")
                else:
                    self.stats.record_failure(reason)
                # Load nothing, but keep the slots so the prefill engine's lease is released.
                remote = dataclasses.replace(remote, num_tokens=0)
        self.parsed[req_id] = remote
        return remote

    def _authenticate(self, remote: RemotePrefill) -> None:
        """Before anything is dialed or resolved for these params: their MAC (an engine with an
        ``auth_token``) and their peer (``prefill_peers``). Raises the refusal."""
        if self._mac_key is not None:
            remote.verify_mac(self._mac_key)
        if not self._allowlist.allows(remote.host, remote.port):
            raise PeerNotAllowedError(
                f"kv_transfer_params name prefill engine {remote.host}:{remote.port}, which is "
                "not in prefill_peers; nothing is dialed"
            )

    def _claim_prompt(self, request: Request, remote: RemotePrefill) -> PromptClaim:
        """(digest, tokens) of this engine's own prompt as the lease must hold it: presented
        with every heartbeat and the claim. ("", 0) (nothing checked) for declined params, which
        load nothing, and for a prompt without token ids."""
        tokens = request.prompt_token_ids
        if tokens is None or remote.num_tokens <= 0:
            return ("", 0)
        n = min(remote.num_tokens, request.num_prompt_tokens)
        return prompt_digest(tokens, n), n

    def _decline_reason(self, request: Request, remote: RemotePrefill) -> tuple[str, str] | None:
        if remote.fallback:
            return "fallback", f"prefill engine sent no KV ({remote.fallback})"
        if remote.format_version != self.record.format_version:
            return (
                "incompatible",
                f"prefill engine speaks turbowire transfer format {remote.format_version}, this "
                f"engine {self.record.format_version} (format 2 added lease tokens); run the "
                "same turbowire version on both engines",
            )
        if remote.preset != self.config.preset:
            return (
                "incompatible",
                f"prefill preset {remote.preset!r} differs from this engine's "
                f"{self.config.preset!r}",
            )
        why = peer_refusal(self.record, remote.tp_size)
        if why is not None:
            return "incompatible", (f"prefill tp_size {remote.tp_size}, this engine's "
                                    f"{self.tp_size}: {why}")
        if remote.prompt_hash is not None and request.prompt_token_ids is not None:
            n = min(remote.num_tokens, request.num_prompt_tokens)
            if prompt_digest(request.prompt_token_ids, n) != remote.prompt_hash:
                return "prompt_mismatch", "prompt tokens differ from the prefill engine's"
        return None

    def _queue_release_only(self, request: Request) -> None:
        if is_cleanup(request):
            remote = self._parse_cleanup(request)
            if remote is not None and self._already_let_go(remote):
                logger.debug(
                    "cleanup request %s: the lease of %s was already released by its load",
                    request.request_id, remote.request_id,
                )
                return
        else:
            remote = self.parse(request)
        if remote is None or not remote.slots:
            return
        self._queue(_load_request(request.request_id, remote, _peer(remote), []))

    def _parse_cleanup(self, request: Request) -> RemotePrefill | None:
        """The params of vLLM's pre-aborted cleanup request, which exists only to let the
        prefill engine free its lease (``notify_kv_transfer_request_rejected``: the serving layer
        refused or errored a request, e.g. after a ``load_failure_policy: fail`` load failure).
        Its prompt is a placeholder (``[0]``), so the load checks (prompt hash, preset, TP)
        do not apply, and nothing is counted: the request it stands for was counted by its own
        load, or never reached the connector. Malformed params are logged, not counted."""
        try:
            remote = RemotePrefill.parse(request.kv_transfer_params or {}, self.block_size)
            self._authenticate(remote)  # nothing goes to a host the params merely name
            return remote
        except TransferParamsError as exc:
            logger.info(
                "cleanup request %s: %s; no lease to release", request.request_id, exc
            )
            return None

    def _queue(self, load: LoadRequest) -> None:
        """Hand a load (or a release) to the workers; remember that its lease is let go."""
        key = (load.peer.engine_id, load.remote_request_id)
        self._let_go[key] = None
        self._let_go.move_to_end(key)
        while len(self._let_go) > MAX_LET_GO:
            self._let_go.popitem(last=False)
        self.pending_loads.append(load)

    def _already_let_go(self, remote: RemotePrefill) -> bool:
        return (remote.engine_id, remote.request_id) in self._let_go

    def close(self) -> None:
        if self._hb_lanes is not None:
            self._hb_lanes.shutdown(wait=False, cancel_futures=True)
        if self.clients is not None:
            self.clients.close()


def _peer(remote: RemotePrefill) -> PeerAddress:
    return PeerAddress(remote.engine_id, remote.host, remote.port, remote.tp_size)


def _load_request(
    req_id: str,
    remote: RemotePrefill,
    peer: PeerAddress,
    blocks: list[LoadBlock],
    block_ids: list[int] | None = None,
    prompt: PromptClaim = ("", 0),
) -> LoadRequest:
    """A load (no blocks: only the release) of ``remote``'s lease, with the lease's token and
    lifetime and this engine's prompt for the claim."""
    return LoadRequest(
        req_id, remote.request_id, peer, blocks, remote.preset, block_ids or [],
        lease_token=remote.lease_token or "", lease_seconds=remote.lease_seconds,
        prompt_digest=prompt[0], prompt_tokens=prompt[1],
    )


def is_cleanup(request: Request) -> bool:
    """vLLM's pre-aborted request (``abort_immediately``): it only runs ``request_finished`` so
    the connector frees what a refused request holds (here: the prefill engine's lease)."""
    return bool(getattr(request, "abort_immediately", False))


def with_drafts(report: dict[str, Any], drafts: Any) -> dict[str, Any]:
    """The request report with its speculative positions (decode engines running drafts)."""
    if drafts is None:
        return report
    return {**report, "spec_drafted_tokens": drafts.drafted,
            "spec_accepted_tokens": drafts.accepted}
