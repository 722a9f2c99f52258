"""turbowire's log lines in the engine log, formatted like vLLM's own.

vLLM configures only its ``vllm`` logger (its own handler, ``propagate=False``); a ``turbowire.*``
logger inside an engine then has no handler and an effective level of WARNING, so INFO lines
(the CPU layout probe, handshakes) vanished and warnings printed without vLLM's prefix. The
connector facade calls :func:`attach_to_vllm_logging` when vLLM constructs it.
"""

from __future__ import annotations

import logging

PACKAGE_LOGGER = "turbowire"


def attach_to_vllm_logging() -> None:
    """Give the ``turbowire`` logger vLLM's handlers and level (once; a no-op when the process
    already configured ``turbowire`` logging itself or vLLM configured none)."""
    ours = logging.getLogger(PACKAGE_LOGGER)
    if ours.handlers:
        return
    theirs = logging.getLogger("vllm")
    if not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False
