"""The dense anchors: what NixlConnector posts for a request's blocks, and the plainest READ of
the same bytes.

(a) NixlConnector's way, as vLLM's worker does it (read in vllm-project/vllm at 002a1057e9ae,
vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py, and at 0016029bf830,
nixl/worker.py with nixl/transfer_plan.py): one agent per worker made with
``nixl_agent_config(num_threads=4, capture_telemetry=True)`` (UCX only); ``register_kv_caches``
registers, in one ``register_memory`` call, two regions per layer (K and V of a
``[2, num_blocks, ...]`` cache, each ``num_blocks * block_len`` bytes); the local and, at the
handshake, the remote descriptor lists are prepped once with one descriptor per (region, block),
region-major (``build_fa_local_descs``, ``build_remote_descs_from_plan``); a request is one
``make_prepped_xfer("READ", ...)`` naming ``region * num_blocks + block`` for every region and
block (``compute_desc_ids_from_plan``) with a ``"{request}:{tp}"`` notification, then
``transfer`` and ``check_xfer_state`` each step until DONE.

(b) the physical limit: the same byte count between two registered contiguous buffers, split
into a few equal descriptors, one unprepped READ (``initialize_xfer``); the best count wins.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

VLLM_NUM_THREADS = 4  # NixlConnector's default ``num_threads`` extra-config value


def vllm_style_agent(nixl: Any, name: str) -> Any:
    """An agent configured as NixlConnectorWorker configures its own for UCX."""
    return nixl.nixl_agent(name, nixl.nixl_agent_config(num_threads=VLLM_NUM_THREADS,
                                                        capture_telemetry=True))


def mem_type(device: torch.device) -> str:
    return "VRAM" if device.type == "cuda" else "DRAM"


def device_id(device: torch.device) -> int:
    return max(device.index or 0, 0) if device.type == "cuda" else 0


@dataclass(frozen=True)
class KVRegions:
    """One worker's NIXL regions: K then V of each layer, ``block_len`` bytes per block."""

    bases: tuple[int, ...]
    num_blocks: int
    block_len: int
    device_id: int

    @classmethod
    def of(cls, caches: list[torch.Tensor]) -> KVRegions:
        """Regions of ``[2, num_blocks, block_size, heads, head_dim]`` caches (K = ``c[0]``)."""
        nb = caches[0].shape[1]
        block_len = caches[0][0, 0].numel() * caches[0].element_size()
        bases = tuple(c[kv].data_ptr() for c in caches for kv in (0, 1))
        return cls(bases, nb, block_len, device_id(caches[0].device))

    def reg_list(self) -> list[tuple[int, int, int, str]]:
        return [(b, self.num_blocks * self.block_len, self.device_id, "") for b in self.bases]

    def block_descs(self) -> np.ndarray:
        """(addr, len, dev) of every (region, block), region-major."""
        blocks = np.arange(self.num_blocks, dtype=np.uint64) * np.uint64(self.block_len)
        addr = (np.array(self.bases, dtype=np.uint64)[:, None] + blocks[None, :]).reshape(-1)
        return np.stack([addr, np.full_like(addr, self.block_len),
                         np.full_like(addr, self.device_id)], axis=1)

    def desc_ids(self, block_ids: list[int]) -> np.ndarray:
        """The descriptor indices of ``block_ids`` in every region, region-major."""
        regions = np.arange(len(self.bases), dtype=np.int64)[:, None]
        return (regions * self.num_blocks + np.asarray(block_ids, np.int64)[None, :]).reshape(-1)


def blocks_digest(caches: list[torch.Tensor], block_ids: list[int], layers: list[int],
                  tokens: int, block: int) -> str:
    """sha256 of the request's K and V rows (its first ``tokens`` token slots, in block-id
    order) of ``layers``: what the dense READ must have copied."""
    h = hashlib.sha256()
    ids = torch.tensor(block_ids, device=caches[0].device)
    for layer in layers:
        rows = caches[layer][:, ids].reshape(2, len(block_ids) * block, -1)[:, :tokens]
        h.update(rows.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def contiguous_rows(addr: int, nbytes: int, dev: int, pieces: int) -> np.ndarray:
    """``nbytes`` from ``addr`` as ``pieces`` near-equal (addr, len, dev) descriptors."""
    bounds = np.linspace(0, nbytes, pieces + 1).astype(np.uint64)
    rows = np.stack([np.uint64(addr) + bounds[:-1], bounds[1:] - bounds[:-1],
                     np.full(pieces, dev, np.uint64)], axis=1)
    return rows[rows[:, 1] > 0]


@dataclass
class ReadResult:
    posted_ns: int
    done_ns: int
    descs_after_merge: int | None = None


def wait_done(agent: Any, handle: Any, timeout_s: float) -> tuple[int, int | None]:
    """Poll as NixlConnector's ``get_finished`` does (each engine step; here back to back) until
    DONE: (the time it was seen done, the telemetry's descriptor count when captured)."""
    limit = time.monotonic() + timeout_s
    while True:
        state = agent.check_xfer_state(handle)
        if state == "DONE":
            done = time.perf_counter_ns()
            try:  # vLLM records the telemetry of every finished READ
                descs = int(agent.get_xfer_telemetry(handle).descCount)
            except Exception:  # noqa: BLE001 - telemetry off or unsupported: not reported
                descs = None
            return done, descs
        if state not in ("PROC", "PEND"):
            raise RuntimeError(f"NIXL READ ended in state {state}")
        if time.monotonic() > limit:
            raise TimeoutError(f"NIXL READ not done after {timeout_s} s")


def prepped_read(agent: Any, local: Any, local_ids: np.ndarray, remote: Any,
                 remote_ids: np.ndarray, notif: bytes, timeout_s: float) -> ReadResult:
    """Anchor (a): one prepped READ of every descriptor named, posted and polled to DONE."""
    t0 = time.perf_counter_ns()
    handle = agent.make_prepped_xfer("READ", local, local_ids, remote, remote_ids,
                                     notif_msg=notif)
    agent.transfer(handle)
    done, descs = wait_done(agent, handle, timeout_s)
    agent.release_xfer_handle(handle)
    return ReadResult(t0, done, descs)


def contiguous_read(agent: Any, peer: str, local_rows: np.ndarray, remote_rows: np.ndarray,
                    mem: str, timeout_s: float) -> ReadResult:
    """Anchor (b): one READ of a few contiguous descriptors, polled to DONE."""
    t0 = time.perf_counter_ns()
    handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local_rows, mem),
                                   agent.get_xfer_descs(remote_rows, mem), peer)
    agent.transfer(handle)
    done, descs = wait_done(agent, handle, timeout_s)
    agent.release_xfer_handle(handle)
    return ReadResult(t0, done, descs)
