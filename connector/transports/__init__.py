"""The NIXL byte mover of the peer-to-peer path: registers staging memory and READs a prefill
engine's staged chunks into this engine's receive buffer (``nixl.NixlTransport``), behind a
small interface (``base.Transport``) that tests replace with an in-process fake.

Not the ``transport`` config key (which paths an engine uses: ``nixl``, ``store``, ``both``)
nor the ``transport`` metric label (``stats.P2P_LABEL``, ``stats.STORE_LABEL``): the store path
moves its bytes through LMCache's tiers (``turbowire.store``), not through this package."""

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
