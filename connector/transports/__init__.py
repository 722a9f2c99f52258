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
    from turbowire.connector.transports.nixl import NixlTransport

    return NixlTransport(
        agent_name=agent_name,
        backends=config.nixl_backends,
        backend_params=config.nixl_backend_params,
        progress_delay_us=config.nixl_progress_delay_us,
    )
