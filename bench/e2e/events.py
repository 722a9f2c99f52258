"""Timestamped benchmark events, appended as JSON lines to ``$TW_BENCH_EVENTS``.

Kept free of heavy imports: the proxy and the connector wrappers (:mod:`turbowire.bench_e2e.timed`)
both write here, and the harness reads the file back. Both engines, the proxy and the harness run on
one machine (network namespaces share the clock), so ``time.time()`` stamps are comparable.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

EVENTS_ENV = "TW_BENCH_EVENTS"
ROLE_ENV = "TW_BENCH_ROLE"


def record(event: str, req_ids: Any, **extra: Any) -> None:
    """Append one line per request id to ``$TW_BENCH_EVENTS`` (no-op when unset or empty)."""
    path = os.environ.get(EVENTS_ENV)
    if not path or not req_ids:
        return
    now = time.time()
    role = os.environ.get(ROLE_ENV, "?")
    ids = [req_ids] if isinstance(req_ids, str) else list(req_ids)
    lines = "".join(json.dumps({"ev": event, "req": str(r), "t": now, "role": role, **extra}) + "\n"
                    for r in ids)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, lines.encode())
    finally:
        os.close(fd)


def read_events(path: Path) -> list[dict[str, Any]]:
    """All events of a file (a torn last line from a killed process is skipped)."""
    out: list[dict[str, Any]] = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
