"""One base for turbowire's exceptions, carrying the metric ``reason`` a failure is counted by.

A load that fails is counted in ``turbowire_kv_transfer_failures_total{reason}``; the reason
comes from the exception's class (or the instance, where one class covers several), never from
its name or from builtin exception types: an ``IndexError`` raised by a bug in turbowire is
``internal``, not a peer's bounds violation.
"""

from __future__ import annotations

from typing import ClassVar

INTERNAL = "internal"


class TurboWireError(Exception):
    """Base of every turbowire exception; ``reason`` is its metric label (snake_case)."""

    reason: ClassVar[str] = INTERNAL


def failure_reason(exc: BaseException) -> str:
    """The metric reason of an exception: its own for turbowire's, ``internal`` otherwise."""
    reason = getattr(exc, "reason", None) if isinstance(exc, TurboWireError) else None
    return reason if isinstance(reason, str) and reason else INTERNAL
