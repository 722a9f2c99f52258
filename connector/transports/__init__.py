"""Transports move staged bytes between engines. One small interface, several implementations
(NIXL peer-to-peer here; the LMCache store path lives in its own module)."""

from turbowire.connector.transports.base import Transfer, TransferState, Transport, TransportError

__all__ = ["Transfer", "TransferState", "Transport", "TransportError"]
