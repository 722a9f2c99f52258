"""A failed load: counted, its decodes abandoned, its lease released, its receive range given
back, or quarantined while a READ may still write into it (``LoadFailures`` is a part of
:class:`~turbowire.connector.loader.KVLoader`; its state lives on the loader).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from turbowire.connector.metadata import LoadReport
from turbowire.connector.transports.base import Transfer, TransferState

if TYPE_CHECKING:
    from turbowire.connector.loader import LoadJob
    from turbowire.connector.staging import ByteRanges
    from turbowire.connector.stats import TurboWireConnectorStats

logger = logging.getLogger(__name__)

# Failure reasons that say the cached handshake of the peer may be stale (the prefill engine
# died, restarted at the same address, or its NIXL agent went away): the next load re-handshakes.
PEER_FAILURES = frozenset({"transport", "peer_unreachable", "timeout"})


def _distinct(xfers: Iterator[Transfer]) -> list[Transfer]:
    """Each transfer once, in order (one READ may carry several layer groups)."""
    seen: set[int] = set()
    out = []
    for x in xfers:
        if id(x) not in seen:
            seen.add(id(x))
            out.append(x)
    return out


@dataclass
class Quarantined:
    """A failed load's receive range that READs still on the wire may write into.

    It is given back only once every one of those READs has ended (DONE or FAILED: NIXL no
    longer writes into it), so a late byte can never land in a range another load decodes from;
    without the hand-back, every load failed on a dead or stalled peer shrank the receive buffer
    for good until loads could only wait for ``transfer_timeout_seconds``.
    """

    offset: int
    nbytes: int
    xfers: list[Transfer]
    agent: str


class LoadFailures:
    """Failing a load and reclaiming what it leaves on the wire (see the module)."""

    stats: TurboWireConnectorStats
    quarantined_bytes: int
    _quarantine: list[Quarantined]
    _recv_ranges: ByteRanges
    _failed: set[str]
    _reports: dict[str, LoadReport]
    _jobs: list[LoadJob]
    _transport: Any
    _peers: Any
    _stale_agents: set[str]

    if TYPE_CHECKING:  # PeerLinks's, on the same loader
        def _forget_peer(self, peer: Any) -> None: ...

        def _release_async(self, load: Any, count_failure: bool = True) -> None: ...

    def _fail(self, job: LoadJob, reason: str, message: str) -> None:
        load = job.load
        logger.error(
            "KV load of request %s from engine %s failed (%s): %s",
            load.request_id, load.peer.engine_id, reason, message,
        )
        self.stats.record_failure(reason)
        self._drop_job(job)
        if reason in PEER_FAILURES:
            self._forget_peer(load.peer)
        self._release_async(load, count_failure=False)  # its failure is counted above
        self._failed.add(load.request_id)
        self._reports[load.request_id] = LoadReport(failed=reason)

    def _drop_job(self, job: LoadJob) -> None:
        """What a failed job leaves behind: its decodes abandoned, its landed READs released,
        its receive range given back or quarantined (also a load's other parts when one part
        failed: the load is counted and reported once, by ``_fail``)."""
        load = job.load
        for pending in job.pending:  # GPU decodes still reading the receive range
            try:
                pending.abandon()
            except Exception as exc:  # noqa: BLE001 - the load has failed already
                logger.debug("abandoning a decode of %s: %s", load.request_id, exc)
        job.pending.clear()
        in_flight = _distinct(
            x for g, x in enumerate(job.xfers)
            if not job.decoded[g] and x.state() is TransferState.PENDING
        )
        if in_flight and job.recv_offset is not None:
            # A READ may still write into the receive range: not reused before it ended.
            self._quarantine.append(
                Quarantined(job.recv_offset, job.recv_nbytes, in_flight, job.peer_agent)
            )
            self.quarantined_bytes += job.recv_nbytes
            logger.warning(
                "receive range [%d, %d) quarantined: %d READ(s) of the failed load may still "
                "write into it", job.recv_offset, job.recv_offset + job.recv_nbytes,
                len(in_flight),
            )
            job.recv_offset = None
        else:
            self._free_recv(job)
        ended = [g for g, x in enumerate(job.xfers)
                 if not job.decoded[g] and x.state() is not TransferState.PENDING]
        for x in _distinct(job.xfers[g] for g in ended):
            x.release()
        for g in ended:
            job.decoded[g] = True

    def _reclaim(self) -> None:
        """Give back quarantined ranges whose READs have all ended; remove the NIXL agents of
        forgotten peers that no READ uses any more."""
        if self._quarantine:
            still: list[Quarantined] = []
            for q in self._quarantine:
                if any(x.state() is TransferState.PENDING for x in q.xfers):
                    still.append(q)
                    continue
                for x in q.xfers:
                    x.release()
                self._recv_ranges.free(q.offset, q.nbytes)
                self.quarantined_bytes -= q.nbytes
                logger.info(
                    "receive range [%d, %d) reclaimed: the failed load's READs ended",
                    q.offset, q.offset + q.nbytes,
                )
            self._quarantine = still
        if self._stale_agents:
            remove = getattr(self._transport, "remove_peer", None)
            in_use = {p.agent for p in self._peers.values()}
            in_use |= {q.agent for q in self._quarantine}
            in_use |= {j.peer_agent for j in self._jobs if j.xfers}
            for agent in sorted(self._stale_agents - in_use):
                self._stale_agents.discard(agent)
                if remove is not None:
                    try:
                        remove(agent)
                    except Exception as exc:  # noqa: BLE001 - NIXL raises its own error types
                        logger.info("removing stale NIXL peer %s: %s", agent, exc)

    def _free_recv(self, job: LoadJob) -> None:
        if job.recv_offset is not None and self._recv_ranges is not None:
            self._recv_ranges.free(job.recv_offset, job.recv_nbytes)
            job.recv_offset = None
