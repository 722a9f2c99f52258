"""The rig: a prefill and a decode worker built the way vLLM builds them, on the stand-ins of
fakes.py (a fake transport and side channel, inline side-channel calls; the connector's tests use
the same ones), a stand-in forward, and the clocks. Only turbowire's public names are used: the
worker's vLLM-facing calls and public attributes, ``KVLoader``'s constructor (everything a loader
talks to is injected there), ``make_coder`` and ``turbowire.kernels``."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SMOKE = os.environ.get("TW_BENCH_SMOKE") == "1"  # CPU + Triton interpreter, tiny shapes
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

from bench.gpu_path import stubs  # noqa: E402

STUBS = stubs.install()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.gpu_path import fakes  # noqa: E402
from bench.gpu_path.forward import stand_in_layers  # noqa: E402
from turbowire.connector.coder import ChunkOffsets, CudaCoder, make_coder  # noqa: E402
from turbowire.connector.metadata import SaveRequest, TurboWireConnectorMetadata  # noqa: E402
from turbowire.connector.worker import TurboWireWorker  # noqa: E402

DEVICE = "cpu" if SMOKE else "cuda"
BLOCK = 16
# Llama-3.1-8B's layer shapes; the smoke mode's are tiny
MODEL = (dict(layers=2, hidden=256, inter=512, q_heads=2, kv_heads=1, head_dim=128) if SMOKE
         else dict(layers=32, hidden=4096, inter=14336, q_heads=32, kv_heads=8, head_dim=128))
TOKENS = [20] if SMOKE else [4096, 32768]
PRESETS = ["tq4"] if SMOKE else ["tq4", "k4v3"]


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def layer_names(n: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


# ------------------------------------------------------------------------------------------
# workers, built as vLLM builds them, on fakes.py's stand-ins
# ------------------------------------------------------------------------------------------
def make_worker(preset: str, role: str, engine_id: str, num_blocks: int, pool_bytes: int,
                layers: int, heads: int, dim: int, groups: int = 8,
                sliding: tuple[str, ...] = (), tp_size: int = 1,
                decode_tp_size: int = 0) -> TurboWireWorker:
    """A worker from stand-ins of vLLM's config objects, through its own constructor;
    ``sliding``: layers in a second KV cache group (vLLM's hybrid KV cache manager);
    ``heads``: one rank's of a TP ``tp_size`` engine; ``decode_tp_size``: the config key (a
    prefill engine cutting its chunks per decode rank's heads)."""
    extra = {"preset": preset, "staging_bytes": pool_bytes, "recv_bytes": pool_bytes,
             "decode_pipeline_groups": groups, "nixl_progress_delay_us": 0,
             "decode_tp_size": decode_tp_size}
    return fakes.build_worker(extra, layer_names(layers), engine_id=engine_id, kv_role=role,
                              block_size=BLOCK, num_kv_heads=heads, head_size=dim,
                              num_blocks=num_blocks, sliding=sliding, tp_size=tp_size)


def use_coder(w: TurboWireWorker, schedule: str = "layerwise",
              kernel_config: Any = "auto") -> CudaCoder:
    """Give the worker a CUDA coder (on CPU: under Triton's interpreter), the coder the bench
    measures; ``schedule``: ``layerwise`` (a launch per ``save_kv_layer``) or ``after_forward``
    (one launch in ``wait_for_save``). On a GPU the worker must have chosen it itself."""
    if not SMOKE and not isinstance(w.coder, CudaCoder):
        raise RuntimeError(f"the worker chose {type(w.coder).__name__}, not the CUDA coder")
    coder = make_coder(w.codec, w.geometry, w.caches, layout=w.layout, staging=w.staging,
                       recv=w.recv, chunk_nbytes=w.chunk_nbytes, save_schedule=schedule,
                       kernel_config=kernel_config, kind="cuda")
    assert isinstance(coder, CudaCoder)
    w.coder = coder
    return coder


def attach_loader(d: TurboWireWorker, p: TurboWireWorker) -> fakes.FakeTransport:
    """Replace the decode worker's loader by one on a fake transport (its READs land when
    posted, unless the bench turns ``auto_land`` off and lands them itself), a fake side
    channel of prefill worker ``p`` that grants every lease, and inline side-channel calls; the
    decode and its preparation are the worker's coder's. Returns the transport."""
    client = fakes.FakeClient(p.layout, p.record, engine_id="prefill", mem_type=p.mem_type)
    return fakes.attach_loader(d, client, fakes.FakeTransport(auto_land=True))


# ------------------------------------------------------------------------------------------
# requests
# ------------------------------------------------------------------------------------------
def save_meta(rid: str, block_ids: list[int], ntok: int,
              slot0: int = 0) -> TurboWireConnectorMetadata:
    return TurboWireConnectorMetadata(
        saves=[fakes.save_request(rid, block_ids, ntok, BLOCK, slot0=slot0)])


def load_meta(rid: str, save: SaveRequest, block_ids: list[int],
              preset: str) -> TurboWireConnectorMetadata:
    """Request ``rid`` loads what ``save`` staged on the prefill engine ("prefill")."""
    return TurboWireConnectorMetadata(loads=[fakes.load_request(rid, save, block_ids, preset)])


def fill_recv(d: TurboWireWorker, p: TurboWireWorker, save: SaveRequest,
              offset: int = 0) -> ChunkOffsets:
    """Put the request's chunks into the decode worker's receive buffer where its loader READs
    them (layer-major, blocks in order), one strided copy per (layer, run of equal sizes)."""
    assert p.staging is not None and d.recv is not None
    n_l = p.geometry.num_layers
    sizes = np.array([[p.chunk_nbytes(layer, b.num_tokens, b.index) for b in save.blocks]
                      for layer in range(n_l)], dtype=np.int64)
    flat = sizes.reshape(-1)
    offs = (np.cumsum(flat) - flat).reshape(sizes.shape)
    slots = [b.slot for b in save.blocks]
    slot_bytes = p.layout.slot_bytes
    for layer in range(n_l):
        lo = p.layout.layer_offsets[layer]
        i = 0
        while i < len(slots):
            j = i
            while (j + 1 < len(slots) and sizes[layer, j + 1] == sizes[layer, i]
                   and slots[j + 1] == slots[j] + 1):
                j += 1
            k, size = j - i + 1, int(sizes[layer, i])
            src = p.staging[slots[i] * slot_bytes:(slots[j] + 1) * slot_bytes].view(k, slot_bytes)
            at = offset + int(offs[layer, i])
            d.recv[at:at + k * size].view(k, size).copy_(src[:, lo:lo + size])
            i = j + 1
    return ChunkOffsets(offs, sizes)


def drain(d: TurboWireWorker, limit: float = 60.0) -> tuple[set[str], set[str]]:
    """Poll as vLLM does each step until no load is pending: (finished, failed)."""
    finished: set[str] = set()
    failed: set[str] = set()
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        f, x = d.get_transfer_results()
        finished |= f
        failed |= x
        if d.loader is None or not d.loader.pending:
            break
    return finished, failed


# ------------------------------------------------------------------------------------------
# the stand-in forward and the clocks
# ------------------------------------------------------------------------------------------
@dataclass
class Forward:
    """bf16 matmuls of one Llama-3.1-8B layer (weights shared by the layers: far larger than L2
    either way) and the layer's KV written into the paged cache, with ``save_kv_layer`` after
    each layer's "attention" and ``wait_for_save`` after the last, as vLLM calls them."""

    tokens: int
    caches: dict[str, torch.Tensor]
    slot_mapping: torch.Tensor
    w: dict[str, torch.Tensor] = field(default_factory=dict)
    kv_heads: int = 0  # the caches' KV heads (0: the model's)

    def __post_init__(self) -> None:
        h, i = MODEL["hidden"], MODEL["inter"]
        self.kv_heads = self.kv_heads or MODEL["kv_heads"]
        kv = self.kv_heads * MODEL["head_dim"]
        g = torch.Generator(device=DEVICE).manual_seed(1)

        def weight(a: int, b: int) -> torch.Tensor:
            return (torch.randn(a, b, generator=g, device=DEVICE) / a ** 0.5).to(torch.bfloat16)

        self.w = {"qkv": weight(h, h + 2 * kv), "o": weight(h, h), "gu": weight(h, 2 * i),
                  "d": weight(i, h)}
        self.x0 = torch.randn(self.tokens, h, generator=g, device=DEVICE).to(torch.bfloat16)

    def run(self, worker: TurboWireWorker | None, meta: Any) -> None:
        stand_in_layers(self.caches, self.w, self.x0, self.slot_mapping, hidden=MODEL["hidden"],
                        kv_heads=self.kv_heads, head_dim=MODEL["head_dim"],
                        inter=MODEL["inter"], worker=worker, meta=meta)
        if worker is not None:
            worker.wait_for_save(meta)


def freeze_gc_heap() -> None:
    """What vLLM's EngineCore does once started (``gc_utils.freeze_gc_heap``): a collection
    while serving does not walk the start-up heap (models, caches, plans, kernels)."""
    for generation in (0, 1, 2):
        gc.collect(generation)
    gc.freeze()


def time_once(fn: Callable[[], None]) -> float:
    """ms of one call: CUDA events on the current stream around it, then a host sync (the step
    boundary); on CPU the wall clock."""
    if DEVICE != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


def bench_ms(fn: Callable[[], Any]) -> float:
    """Median ms of ``fn`` (triton's do_bench); smoke: one call's wall time."""
    if SMOKE:
        return time_once(fn)
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def fit(value: float, width: int, decimals: int, sign: str = "") -> str:
    """``value`` in at most ``width`` characters: fewer decimals first, then powers of ten (the
    CPU smoke run's timings can be any size; the table stays within 80 columns)."""
    for d in range(decimals, -1, -1):
        text = f"{value:{sign}.{d}f}"
        if len(text) <= width:
            return text
    return f"{value:{sign}.0e}"
