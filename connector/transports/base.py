"""The transport interface the worker codes against."""

from __future__ import annotations

import enum
from typing import Protocol

import numpy as np

from turbowire.errors import TurboWireError


class TransportError(TurboWireError, RuntimeError):
    """A transfer could not be posted or finished in error."""

    reason = "transport"


class TransferState(enum.Enum):
    PENDING = "PROC"
    DONE = "DONE"
    FAILED = "ERR"


class Transfer(Protocol):
    """One posted transfer; poll ``state`` until DONE or FAILED, then ``release``."""

    nbytes: int

    def state(self) -> TransferState: ...

    def release(self) -> None: ...


class NothingToRead:
    """The transfer of a READ with no rows (every chunk of its layers stays on the peer): done
    at once, nothing posted."""

    def state(self) -> TransferState:
        return TransferState.DONE

    def release(self) -> None:
        pass


class Transport(Protocol):
    """Moves byte ranges between registered memory of two engines."""

    name: str
    agent_name: str  # this end's identity, advertised to peers in the handshake

    def register(self, tensor: object) -> None: ...

    def local_metadata(self) -> bytes: ...

    def add_peer(self, metadata: bytes) -> str: ...

    def read(
        self,
        peer: str,
        local: np.ndarray,
        remote: np.ndarray,
        mem_type: str,
        notif: bytes = b"",
    ) -> Transfer: ...

    def close(self) -> None: ...
