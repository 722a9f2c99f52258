"""The decode side's heartbeats: they keep a prefill engine's lease alive while the request
that will load it waits in this engine's queue.

A ``do_remote_prefill`` request is heartbeated from its arrival (the first heartbeat soon after,
within the prefill engine's ``claim_timeout_seconds``, then every third of ``lease_seconds``)
until its load is queued or it is dropped, presenting this engine's prompt each time. The calls
go out on one lane per peer, so the scheduler's maintenance thread never waits on the network
and a peer that never answers delays no other peer's heartbeats; a lease the peer refuses or
holds for another prompt is heartbeated no more. ``Heartbeats`` is a part of
:class:`~turbowire.connector.receiver.Receiver` (its state lives on the receiver).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from turbowire.connector.config import MIN_CLAIM_TIMEOUT_SECONDS
from turbowire.connector.staging import PromptClaim

if TYPE_CHECKING:
    from turbowire.connector.config import TurboWireConfig
    from turbowire.connector.params import RemotePrefill
    from turbowire.connector.stats import TurboWireConnectorStats

logger = logging.getLogger(__name__)

#: A waiting decode request's first heartbeat goes out this long after it arrived (its load's
#: claim usually comes first): well within the prefill engine's claim_timeout_seconds
FIRST_HEARTBEAT_S = MIN_CLAIM_TIMEOUT_SECONDS / 2


@dataclass
class HeartbeatTarget:
    host: str
    port: int
    remote_request_id: str
    lease_token: str = field(repr=False)  # the lease's capability: never in a repr or log line
    interval: float
    # set so that the first heartbeat goes out FIRST_HEARTBEAT_S after arrival: it claims the
    # lease of a request still queued here before the prefill engine's claim_timeout_seconds
    last_sent: float = field(default_factory=time.monotonic)
    prompt: PromptClaim = ("", 0)  # this engine's prompt (digest, tokens), presented with it
    request_id: str = ""  # the decode request waiting for it


class Heartbeats:
    """The heartbeats of a receiver's waiting requests (see the module)."""

    config: TurboWireConfig
    engine_id: str
    tp_size: int  # this engine's: the prefill engine frees a lease after that many releases
    stats: TurboWireConnectorStats
    heartbeats: dict[str, HeartbeatTarget]
    clients: Any  # ClientPool, made on the first heartbeat
    _hb_lock: threading.Lock
    _hb_inflight: set[tuple[str, int]]  # peers with a heartbeat on the wire
    _hb_lanes: Any  # PeerExecutors: heartbeats to each peer on its own thread

    def start_heartbeat(self, req_id: str, remote: RemotePrefill, prompt: PromptClaim) -> None:
        """Heartbeat ``remote``'s lease for the waiting request ``req_id``, every third of the
        lease's lifetime, presenting this engine's ``prompt``."""
        interval = max(0.5, remote.lease_seconds / 3)
        with self._hb_lock:
            self.heartbeats[req_id] = HeartbeatTarget(
                host=remote.host,
                port=remote.port,
                remote_request_id=remote.request_id,
                lease_token=remote.lease_token or "",
                interval=interval,
                last_sent=time.monotonic() - interval + min(interval, FIRST_HEARTBEAT_S),
                prompt=prompt,
                request_id=req_id,
            )

    def stop_heartbeat(self, req_id: str) -> None:
        with self._hb_lock:
            self.heartbeats.pop(req_id, None)

    def send_heartbeats(self) -> None:
        """Hand the due heartbeats to their peers' lanes (one call per peer, at most
        ``MAX_IDS_PER_CALL`` ids each, a peer skipped while its last one is on the wire): the
        maintenance thread never waits on the network, and a peer that never answers delays
        no other peer's heartbeats (they were sent one peer after another, each up to
        ``handshake_timeout_seconds``)."""
        now = time.monotonic()
        due: dict[tuple[str, int], list[HeartbeatTarget]] = {}
        with self._hb_lock:
            for target in self.heartbeats.values():
                key = (target.host, target.port)
                if key in self._hb_inflight:
                    continue
                if now - target.last_sent >= target.interval:
                    target.last_sent = now
                    due.setdefault(key, []).append(target)
            self._hb_inflight.update(due)
        if not due:
            return
        if self.clients is None:
            from turbowire.connector.sidechannel.client import ClientPool

            self.clients = ClientPool.from_config(self.config)
        if self._hb_lanes is None:
            from turbowire.connector.sidechannel.client import PeerExecutors

            self._hb_lanes = PeerExecutors(self.config.max_peers, threads_per_peer=1,
                                           thread_name_prefix="tw-heartbeat")
        for key, targets in due.items():
            try:
                self._hb_lanes.submit_to(key, self._heartbeat_peer, key, targets)
            except RuntimeError:  # shut down
                with self._hb_lock:
                    self._hb_inflight.discard(key)

    def _heartbeat_peer(self, key: tuple[str, int], targets: list[HeartbeatTarget]) -> None:
        """One peer's heartbeats (its lane's thread); refused or mismatched leases are not
        heartbeated again."""
        from turbowire.connector.sidechannel.client import batched

        host, port = key
        try:
            for rows in batched(targets):
                batch = [targets[i] for i in rows]
                try:
                    reply = self.clients.get(host, port).heartbeat(
                        [t.remote_request_id for t in batch], self.engine_id,
                        lease_tokens=[t.lease_token for t in batch],
                        prompts=[t.prompt for t in batch], tp_size=self.tp_size,
                    )
                except Exception as exc:  # noqa: BLE001 - logged and counted, retried next period
                    logger.warning("heartbeat to %s:%d failed: %s", host, port, exc)
                    self.stats.record_failure("peer_unreachable")
                    return
                self.heartbeat_answered(host, port, batch, reply)
        finally:
            with self._hb_lock:
                self._hb_inflight.discard(key)

    def heartbeat_answered(self, host: str, port: int, batch: list[HeartbeatTarget],
                           reply: Any) -> None:
        """Log what a peer refused; refused or mismatched leases are heartbeated no more."""
        refused = set(reply.refused)
        mismatched = set(getattr(reply, "prompt_mismatch", ()))
        if refused:
            logger.warning(
                "prefill engine %s:%d refused heartbeats for leases %s: the lease token in "
                "their kv_transfer_params is not the lease's (altered params, or another "
                "request's)", host, port, sorted(refused)[:5],
            )
        if mismatched:
            logger.warning(
                "prefill engine %s:%d refused heartbeats for leases %s: they hold the KV of "
                "another prompt than this engine's requests (kv_transfer_params of another "
                "prompt)", host, port, sorted(mismatched)[:5],
            )
        expired = [rid for rid in reply.unknown if rid not in refused and rid not in mismatched]
        if expired:
            logger.warning(
                "prefill engine %s:%d no longer holds leases %s (expired?)",
                host, port, expired[:5],
            )
        if refused or mismatched:
            with self._hb_lock:
                for t in batch:
                    if t.remote_request_id in refused | mismatched and t.request_id:
                        self.heartbeats.pop(t.request_id, None)
