"""turbowire.connector: the vLLM KV connector (compressed P2P transfer over NIXL).

``TurboWireConnector`` is imported lazily so that light submodules (config, params, staging)
do not pull in vLLM. Tools that run outside an engine (proxy, launcher, demo) live in
``turbowire.serving``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TurboWireConnector"]


def __getattr__(name: str) -> Any:
    if name == "TurboWireConnector":
        from turbowire.connector.connector import TurboWireConnector

        return TurboWireConnector
    raise AttributeError(f"module 'turbowire.connector' has no attribute {name!r}")
