"""What both processes of a case share: the case, the block tables, the workers as vLLM builds
them (bench/gpu_path/fakes.py's constructors, real NIXL), the pipe's messages and the clocks.

Import it only after ``env.prepare_process``: it imports turbowire, and through it vLLM's names.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from bench.gpu_path import fakes
from bench.gpu_pipeline.case import Case
from bench.gpu_pipeline.env import SMOKE
from bench.gpu_pipeline.models import BLOCK, layer_names
from turbowire.codec import Codec
from turbowire.connector.coder import CudaCoder
from turbowire.connector.worker import TurboWireWorker


def block_tables(case: Case) -> tuple[list[int], list[int]]:
    """The request's blocks in the producer's and the consumer's caches: scattered, as vLLM's
    block pool hands them out after a while (bench/gpu_path/case.py's tables)."""
    perm = torch.randperm(case.cache_blocks, generator=torch.Generator().manual_seed(7)).tolist()
    return perm[:case.num_blocks], perm[::-1][:case.num_blocks]


def device_of(case: Case, role: str) -> torch.device:
    if SMOKE:
        return torch.device("cpu")
    dev = torch.device("cuda", case.devices[0 if role == "producer" else 1])
    torch.cuda.set_device(dev)
    return dev


def pool_bytes(case: Case, preset: str) -> int:
    """A staging pool (and receive buffer) holding the request: bench/gpu_path/case.py's."""
    m = case.model
    codec = Codec(preset, m.head_dim, m.layers)
    per_slot = sum(codec.encoded_nbytes(i, BLOCK, m.kv_heads) + 64 for i in range(m.layers))
    return max(1 << 20, per_slot * (case.num_blocks + 8))


def make_worker(case: Case, preset: str, role: str, engine_id: str) -> TurboWireWorker:
    """A worker from stand-ins of vLLM's config objects, through its own constructor, with the
    connector's NIXL transport (a real agent) and, on a GPU, the CUDA coder it chose itself
    (smoke: forced, under Triton's interpreter)."""
    m = case.model
    size = pool_bytes(case, preset)
    extra = {"preset": preset, "staging_bytes": size, "recv_bytes": size,
             "decode_pipeline_groups": case.groups,
             "nixl_progress_delay_us": case.progress_delay_us,
             "transfer_timeout_seconds": case.timeout_s}
    return fakes.build_worker(extra, layer_names(m.layers), engine_id=engine_id, kv_role=role,
                              block_size=BLOCK, num_kv_heads=m.kv_heads, head_size=m.head_dim,
                              num_blocks=case.cache_blocks)


def use_cuda_coder(w: TurboWireWorker) -> None:
    """The CUDA coder (before a loader is attached: it binds the coder's decode)."""
    if SMOKE:
        w.coder = w.make_coder("cuda")
    elif not isinstance(w.coder, CudaCoder):
        raise RuntimeError(f"the worker chose {type(w.coder).__name__}, not the CUDA coder")


def close_worker(w: TurboWireWorker) -> None:
    """Shut down and drop it: its NIXL agent (and progress thread) goes with the last reference."""
    w.shutdown()
    del w
    gc.collect()


def sync() -> None:
    if torch.cuda.is_available() and not SMOKE:
        torch.cuda.synchronize()


def stream_sync() -> None:
    """Wait for the current stream only (the forward's), not for side streams."""
    if torch.cuda.is_available() and not SMOKE:
        torch.cuda.current_stream().synchronize()


def now_ns() -> int:
    """The cross-process clock: ``perf_counter_ns`` is CLOCK_MONOTONIC on Linux, one clock for
    every process of a host (CUDA events cannot be compared across processes)."""
    return time.perf_counter_ns()


def expect(conn: Any, kind: str) -> Any:
    """The peer's next message, which must be ``kind``; a peer's failure is raised here."""
    got, payload = conn.recv()
    if got == "error":
        raise RuntimeError(f"the other process failed: {payload}")
    if got != kind:
        raise RuntimeError(f"expected {kind!r} from the other process, got {got!r}")
    return payload
