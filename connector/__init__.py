"""turbowire.connector: the vLLM KV connector (compressed P2P transfer over NIXL).

``TurboWireConnector`` is imported lazily so that light submodules (config, params, staging,
proxy) do not pull in vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TurboWireConnector"]


def __getattr__(name: str) -> Any:
    if name == "TurboWireConnector":
        from turbowire.connector.connector import TurboWireConnector

        return TurboWireConnector
    raise AttributeError(f"module 'turbowire.connector' has no attribute {name!r}")
