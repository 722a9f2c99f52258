"""NIXL transport: one agent per worker, registered staging/receive buffers, one-sided READs.

The decode worker READs compressed chunks out of the prefill worker's staging pool into its own
receive buffer. UCX is the default backend; UCX settings come from the usual environment
(``UCX_TLS``, ``UCX_NET_DEVICES``) or from ``nixl_backend_params`` (e.g. ``ucx_devices``).
Descriptor arrays are (address, length, device) rows; callers bounds-check them against the
peer's advertised geometry before calling :meth:`NixlTransport.read`, and NIXL itself refuses
ranges outside registered memory.

The agent's progress thread sleeps ``progress_delay_us`` between polls. NIXL's Python API
hard-codes 0, and a progress thread that never sleeps burns a whole core: on an engine pinned to
one core (vLLM on CPU) it halved the speed of everything else there, the codec included. With
100 us an idle agent uses ~3% of a core; loopback READ goodput was noisy either way (0.32-0.75
GB/s busy-polling, 0.33-0.43 GB/s at 100 us, bench/RESULTS.md "NIXL progress thread"), so hosts
with cores to spare and fast links may prefer 0 (``nixl_progress_delay_us``).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from turbowire.connector.transports.base import TransferState, TransportError

logger = logging.getLogger(__name__)


class NixlUnavailableError(TransportError):
    """The nixl package (or the requested backend) is not usable in this process."""


def _import_nixl() -> tuple[Any, Any]:
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:  # pragma: no cover - the Makefile installs nixl
        raise NixlUnavailableError(
            "NIXL is not importable: install the 'nixl' extra (make setup does) and make sure the "
            "nixl_cu12/nixl_cu13 variant matching this process's CUDA is present"
        ) from exc
    return nixl_agent, nixl_agent_config


_AGENT_LOCK = threading.Lock()


def make_agent(name: str, progress_delay_us: int) -> Any:
    """A nixl_agent whose progress thread sleeps ``progress_delay_us`` between polls
    (0: NIXL's default busy polling)."""
    nixl_agent, nixl_agent_config = _import_nixl()
    config = nixl_agent_config(backends=[])
    if progress_delay_us == 0:
        return nixl_agent(name, config)
    api = sys.modules[nixl_agent.__module__]
    bind = getattr(api, "nixlBind", None)
    make = getattr(bind, "nixlAgent", None)
    if make is None:
        logger.warning(
            "this NIXL version's Python API has no nixlBind.nixlAgent: its progress thread "
            "busy-polls (nixl_progress_delay_us ignored)"
        )
        return nixl_agent(name, config)

    def with_delay(agent_name: str, agent_config: Any) -> Any:
        agent_config.pthrDelay = progress_delay_us
        return make(agent_name, agent_config)

    with _AGENT_LOCK:  # the API reads nixlBind.nixlAgent while constructing
        bind.nixlAgent = with_delay
        try:
            return nixl_agent(name, config)
        finally:
            bind.nixlAgent = make


@dataclass
class NixlTransfer:
    """A posted NIXL transfer."""

    agent: Any
    handle: Any
    nbytes: int
    started: float = field(default_factory=time.perf_counter)
    _state: TransferState = TransferState.PENDING

    def state(self) -> TransferState:
        """PENDING until NIXL reports DONE; any other answer, or an error raised while asking
        (``nixlRemoteDisconnectError`` once the peer died), is FAILED: never raised into the
        loader, which asks while it tears a failed load down (vLLM's NixlConnector counts such
        an error as a failed transfer too)."""
        if self._state is TransferState.PENDING:
            try:
                raw = self.agent.check_xfer_state(self.handle)
            except Exception as exc:  # noqa: BLE001 - NIXL raises its own error types
                logger.warning("NIXL transfer state: %s: %s (counted as failed)",
                               type(exc).__name__, exc)
                self._state = TransferState.FAILED
                return self._state
            if raw == "DONE":
                self._state = TransferState.DONE
            elif raw != "PROC":
                self._state = TransferState.FAILED
        return self._state

    def release(self) -> None:
        try:
            self.handle.release()
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own error types
            logger.warning("releasing a NIXL transfer handle failed: %s", exc)


class NixlTransport:
    """A NIXL agent owning this worker's registered buffers."""

    name = "nixl"

    def __init__(
        self,
        agent_name: str | None = None,
        backends: Sequence[str] = ("UCX",),
        backend_params: Mapping[str, Mapping[str, str]] | None = None,
        progress_delay_us: int = 100,
    ) -> None:
        self.agent_name = agent_name or f"turbowire-{uuid.uuid4().hex[:12]}"
        self.backends = list(backends)
        self.agent = make_agent(self.agent_name, progress_delay_us)
        params = backend_params or {}
        for backend in self.backends:
            if backend not in self.agent.get_plugin_list():
                raise NixlUnavailableError(
                    f"NIXL backend {backend!r} is not available (plugins: "
                    f"{self.agent.get_plugin_list()}); fix nixl_backends"
                )
            self.agent.create_backend(backend, dict(params.get(backend, {})))
        self._registrations: list[Any] = []
        self._peers: dict[bytes, str] = {}
        self._lock = threading.Lock()

    def register(self, tensor: Any) -> None:
        """Register a contiguous tensor (DRAM or VRAM) for transfers."""
        if not tensor.is_contiguous():
            raise TransportError("NIXL needs a contiguous buffer")
        reg = self.agent.register_memory(tensor, backends=self.backends)
        if reg is None:
            raise TransportError("NIXL could not register the staging buffer")
        self._registrations.append(reg)

    def local_metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's agent metadata (once) and pre-connect, so the first READ is not slow."""
        with self._lock:
            name = self._peers.get(metadata)
            if name is not None:
                return name
            raw = self.agent.add_remote_agent(metadata)
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            self._peers[metadata] = name
        try:
            self.agent.make_connection(name)
        except Exception as exc:  # noqa: BLE001 - pre-connect is an optimisation only
            logger.info("NIXL pre-connect to %s failed (%s); the first READ connects", name, exc)
        return name

    def remove_peer(self, name: str) -> None:
        with self._lock:
            for meta, peer in list(self._peers.items()):
                if peer == name:
                    del self._peers[meta]
        try:
            self.agent.remove_remote_agent(name)
        except Exception as exc:  # noqa: BLE001
            logger.info("removing NIXL peer %s: %s", name, exc)

    def read(
        self,
        peer: str,
        local: np.ndarray,
        remote: np.ndarray,
        mem_type: str,
        notif: bytes = b"",
    ) -> NixlTransfer:
        """Post a READ of ``remote`` rows of the peer into ``local`` rows (same lengths)."""
        if local.shape != remote.shape or local.ndim != 2 or local.shape[1] != 3:
            raise TransportError("descriptor arrays must both be Nx3 (addr, len, dev)")
        if not np.array_equal(local[:, 1], remote[:, 1]):
            raise TransportError("local and remote descriptor lengths differ")
        nbytes = int(local[:, 1].sum())
        try:
            # no copy when the rows already are contiguous uint64 (the loader's are)
            local_descs = self.agent.get_xfer_descs(
                np.ascontiguousarray(local, dtype=np.uint64), mem_type)
            remote_descs = self.agent.get_xfer_descs(
                np.ascontiguousarray(remote, dtype=np.uint64), mem_type)
            handle = self.agent.initialize_xfer(
                "READ", local_descs, remote_descs, peer, notif, backends=self.backends
            )
            state = self.agent.transfer(handle, notif)
        except Exception as exc:  # noqa: BLE001 - NIXL raises nixl*Error types
            raise TransportError(f"NIXL READ from {peer} could not be posted: {exc}") from exc
        xfer = NixlTransfer(self.agent, handle, nbytes)
        if state == "ERR":
            xfer._state = TransferState.FAILED
        elif state == "DONE":
            xfer._state = TransferState.DONE
        return xfer

    def close(self) -> None:
        for peer in list(self._peers.values()):
            self.remove_peer(peer)
        for reg in self._registrations:
            try:
                self.agent.deregister_memory(reg, backends=self.backends)
            except Exception as exc:  # noqa: BLE001
                logger.info("NIXL deregister failed: %s", exc)
        self._registrations.clear()
