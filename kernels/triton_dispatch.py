"""Hook for the Triton implementations (CUDA caches). Until they land nothing applies."""

from __future__ import annotations

from typing import Any

import torch


def applies(codec: Any, kv_cache: torch.Tensor) -> bool:
    return False


def encode_into(*args: Any, **kwargs: Any) -> list[int]:  # pragma: no cover - not reachable
    raise RuntimeError("no Triton encode kernel for this cache")


def decode_into(*args: Any, **kwargs: Any) -> None:  # pragma: no cover - not reachable
    raise RuntimeError("no Triton decode kernel for this cache")
