"""A load's READs on the wire: ``READS_IN_FLIGHT`` layer groups at a time (every group left in
one READ once the link outpaces the engine's polls), and the runs of landed groups handed to the
decode; ``likely_runs`` tells the coder beforehand which runs those may be.

``ReadPipeline`` is a part of :class:`~turbowire.connector.loader.KVLoader` (its state lives on
the loader): ``KVLoader._post`` plans a load's READs and posts the first ones, ``read_plan``
says where they land (their groups and descriptor rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from turbowire.connector import probe
from turbowire.connector.loader_peers import LoadFailed
from turbowire.connector.transports.base import (
    NothingToRead,
    Transfer,
    TransferState,
    Transport,
    TransportError,
)

if TYPE_CHECKING:
    from turbowire.connector.loader import LoadJob


# Layer-group READs of one load on the wire at once: two keep the link busy while the group
# that landed is decoded, and the groups land one after another instead of all at the end.
READS_IN_FLIGHT = 2


def likely_runs(groups: Sequence[range], n_layers: int) -> list[range]:
    """Runs of layer groups this loader hands over in one decode call besides single groups
    (the coder prepares a launch for each, ``ChunkOffsets.runs``): all layers (every READ
    landed by one poll), and with more than ``READS_IN_FLIGHT`` groups the groups of the first
    READs, then the rest (a poll found the first READs landed and posted the rest in one READ:
    ``ReadPipeline._link_idle``)."""
    if len(groups) <= 1:
        return []
    runs = [range(n_layers)]
    if len(groups) > READS_IN_FLIGHT:
        split = groups[READS_IN_FLIGHT - 1].stop
        runs.append(range(groups[0].start, split))
        if len(groups) > READS_IN_FLIGHT + 1:  # else the rest is one group, handed over alone
            runs.append(range(split, n_layers))
    return runs


class ReadPipeline:
    """Posting a load's READs and taking its landed groups (see the module)."""

    mem_type: str
    _transport: Transport

    if TYPE_CHECKING:  # LoadFailures's, on the same loader
        def _free_recv(self, job: LoadJob) -> None: ...

    def _landed(self, job: LoadJob) -> tuple[range, list[Transfer]] | None:
        with probe.mark("loader.take_landed"):
            return self._take_landed(job)

    def _take_landed(self, job: LoadJob) -> tuple[range, list[Transfer]] | None:
        """The layers of the next run of landed groups and their READ handles (the caller
        releases them once the run's decode is launched, even if it raises), the next READs
        posted; None if the next group has not landed. A poll that finds the link idle posts
        every group left in one READ first (two at a time would cost a poll, an engine step, per
        two groups)."""
        g = next((i for i, d in enumerate(job.decoded) if not d), len(job.xfers))
        first = g
        handles: list[Transfer] = []
        try:
            if self._link_idle(job, g):
                with probe.mark("loader.post_reads"):
                    self._post_more(job, rest=True)
            while g < len(job.xfers):
                xfer = job.xfers[g]
                if not handles or handles[-1] is not xfer:  # one READ may carry several groups
                    state = xfer.state()  # (asked once per READ: they landed together)
                    if state is TransferState.PENDING:
                        break
                    if state is TransferState.FAILED:
                        raise LoadFailed("transport",
                                         f"NIXL READ of layer group {g} finished in error")
                    handles.append(xfer)
                job.decoded[g] = True  # handed over: its handle is the caller's to release
                g += 1
                self._post_more(job)  # before the decode; a READ posted here may have landed
        except BaseException:
            for xfer in handles:  # landed, never decoded: the load fails, the handles go
                xfer.release()
            raise
        if g == first:
            return None
        return range(job.groups[first].start, job.groups[g - 1].stop), handles

    @staticmethod
    def _link_idle(job: LoadJob, g: int) -> bool:
        """Every READ posted and not yet decoded has landed (from group ``g`` on) and groups are
        left to post: the link went idle before this poll, i.e. the READs land faster than the
        engine polls (vLLM polls once per step)."""
        if len(job.xfers) >= len(job.groups) or g >= len(job.xfers):
            return False
        return all(job.xfers[i].state() is not TransferState.PENDING
                   for i in range(g, len(job.xfers)))

    def _post_more(self, job: LoadJob, rest: bool = False) -> None:
        """Keep READS_IN_FLIGHT layer groups on the wire. Posting every group at once made them
        share the link and land together at the end, leaving nothing to overlap the decode with.
        ``rest``: every group not posted yet, in one READ (the link went idle waiting for a poll:
        two at a time would cost a poll, an engine step, per two groups)."""
        if len(job.xfers) >= len(job.groups):
            return
        assert job.rows is not None  # set when the READs are posted
        if rest:
            local, remote = job.rows.rest(len(job.xfers))
            self._post_read(job, local, remote, len(job.groups) - len(job.xfers))
            return
        in_flight = sum(1 for g in range(len(job.xfers)) if not job.decoded[g])
        while in_flight < READS_IN_FLIGHT and len(job.xfers) < len(job.groups):
            local, remote = job.rows.group(len(job.xfers))
            self._post_read(job, local, remote, 1)
            in_flight += 1

    def _post_read(self, job: LoadJob, local: np.ndarray, remote: np.ndarray,
                   groups: int) -> None:
        """One READ carrying the next ``groups`` layer groups (``job.xfers`` holds it once per
        group)."""
        if not len(local):  # no chunk of these layers moves (sliding-window groups)
            job.xfers.extend([NothingToRead()] * groups)
            job.decoded.extend([False] * groups)
            return
        try:
            xfer = self._transport.read(job.peer_agent, local, remote, self.mem_type)
        except TransportError:
            if not job.xfers:
                self._free_recv(job)
            raise  # READs already posted may still land: _fail quarantines the range
        job.xfers.extend([xfer] * groups)
        job.decoded.extend([False] * groups)
