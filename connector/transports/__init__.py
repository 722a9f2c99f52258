"""Transports move staged bytes between engines: one small interface (``base.Transport``), an
implementation per path (NIXL peer to peer today), and one factory the worker calls."""

from __future__ import annotations

from typing import TYPE_CHECKING

from turbowire.connector.transports.base import Transfer, TransferState, Transport, TransportError

if TYPE_CHECKING:
    from turbowire.connector.config import TurboWireConfig

__all__ = ["Transfer", "TransferState", "Transport", "TransportError", "make_transport"]


def make_transport(config: TurboWireConfig, agent_name: str) -> Transport:
    """The transport of this engine's peer-to-peer path (imported lazily: NIXL is heavy)."""
    from turbowire.connector import threads
    from turbowire.connector.transports.nixl import NixlTransport

    # the agent starts NIXL's progress thread and UCX's async thread: off the OpenMP master's
    # core (connector/threads.py says why)
    with threads.threads_started_on(threads.resolve(config.connector_thread_cpus)):
        return NixlTransport(
            agent_name=agent_name,
            backends=config.nixl_backends,
            backend_params=config.nixl_backend_params,
            progress_delay_us=config.nixl_progress_delay_us,
        )
