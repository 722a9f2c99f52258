"""The connector's worker-side GPU path, driven as vLLM's model runner drives it (issue 18).

Run on the GPU machine with its system python (torch + triton, no vLLM, no NIXL, no gRPC):
``python3 bench/gpu_connector_path.py --out $OUT``. The worker is built through its own
constructor from minimal stand-ins of vLLM's config objects (stub modules replace the few vLLM
classes turbowire imports when vLLM is not installed), with a fake transport and fake
side-channel clients; everything between vLLM's calls and the kernels is the real code.

1. Bit-exactness on the GPU: ``bench/kernels.py``'s kernel checks (EncodePlan/DecodePlan vs the
   reference codec on the same GPU) for the presets, then the connector path itself: a small
   model's chunks staged by ``save_kv_layer`` (per-layer and batched launches) byte-equal to the
   reference codec's, decoded by the loader through ``_decode_group`` equal (bitwise) to the
   reference decode, a corrupt chunk refused (its load failed) with nothing of that chunk
   written and the other chunks of its group equal to the reference decode.
2. Prefill: Llama-3.1-8B layer shapes (32 layers, hidden 4096, intermediate 14336, 32 q heads,
   8 KV heads x hd128, block size 16, vLLM's GPU cache layout [2, blocks, 16, 8, 128] per layer,
   block ids shuffled), a stand-in forward of bf16 matmuls (qkv, o, gate_up, down) with the
   layer's KV written into the paged cache, ``save_kv_layer`` after each layer's "attention"
   and ``wait_for_save`` after the last, as vLLM calls them. Paired rounds (``paired_rounds``:
   forward, v1, forward, v2, ..., forward; a variant's sample is its time minus the mean of the
   forwards beside it; an A/A difference of forwards gives the noise) for the per-layer
   launches, one batched launch, per-layer on a high-priority side stream, per-layer + a host
   sync, per-layer on the forward's own stream (with ``--encode-cap N`` also per-layer with the
   encoder capped at N registers), and the pre-plan path of one ``encode_into`` per layer; SM
   clock and power through NVML meanwhile; the encode kernels alone (one launch); a CUDA-graph
   capture of one layer's encode launch vs the eager launch (``graph_probe``); with ``--trace``
   a torch.profiler kernel timeline of one step per variant (encode time, the part of it beside
   forward kernels).
3. Decode: the same request loaded by a decode worker (its ``KVLoader``; the bytes already in
   the receive buffer, the READs held until all of them land at one instant) from the landing
   to ``get_finished`` reporting it, per request, vs the one-launch decode (the fused verify +
   decode of every chunk: one launch per layer policy) of the same bytes; also with the launch
   deferred to the first ask (``eager_groups`` off), a decode call per READ (the loader's
   ``merge_landed`` off), with the decode's
   CUDA graphs off, and with READs that are done when posted (``start_load_kv`` to
   finished, the plan build and graph captures included). Every load's result is compared with
   the one-launch decode, a few chunks with the reference codec. ``--decode-variants`` also
   times the one-launch decode in other launch shapes (programs per chunk, warps), each
   checked against the default's result; ``--load-timeline`` marks every call on a held
   load's path (loader, worker, GPU path, torch) with perf counters and prints where landed ->
   finished goes, no profiler.

At 4k and 32k tokens, presets tq4 and k4v3, with the connector's launch shape for 16-token
chunks (``gpu_path.default_kernel_config``; ``--sweep`` times the shapes of CONFIGS first and
checks each against the default shape's bytes). Prints a table; writes results.json,
results.md and log.txt under --out ($OUT).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
import types
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SMOKE = os.environ.get("TW_BENCH_SMOKE") == "1"  # CPU + Triton interpreter, tiny shapes
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"


# ------------------------------------------------------------------------------------------
# imports: turbowire from the source tree, stand-ins for vLLM where it is not installed
# ------------------------------------------------------------------------------------------
def _stub_vllm() -> None:
    """The vLLM names turbowire's worker side imports, as plain classes."""
    from abc import ABC
    from dataclasses import dataclass as dc
    from dataclasses import field as fld

    def mod(name: str) -> types.ModuleType:
        m = sys.modules.get(name)
        if m is None:
            m = types.ModuleType(name)
            m.__path__ = []  # type: ignore[attr-defined]
            sys.modules[name] = m
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(mod(parent), child, m)
        return m

    base = mod("vllm.distributed.kv_transfer.kv_connector.v1.base")

    class KVConnectorMetadata(ABC):  # noqa: B024
        pass

    class KVConnectorHandshakeMetadata(ABC):  # noqa: B024
        pass

    class KVConnectorWorkerMetadata(ABC):  # noqa: B024
        pass

    base.KVConnectorMetadata = KVConnectorMetadata
    base.KVConnectorHandshakeMetadata = KVConnectorHandshakeMetadata
    base.KVConnectorWorkerMetadata = KVConnectorWorkerMetadata
    metrics = mod("vllm.distributed.kv_transfer.kv_connector.v1.metrics")

    @dc
    class KVConnectorStats:
        data: dict = fld(default_factory=dict)

    metrics.KVConnectorStats = KVConnectorStats
    ps = mod("vllm.distributed.parallel_state")

    def get_tensor_model_parallel_rank() -> int:
        raise AssertionError("no vLLM parallel state in this benchmark")

    ps.get_tensor_model_parallel_rank = get_tensor_model_parallel_rank
    kvi = mod("vllm.v1.kv_cache_interface")

    @dc
    class AttentionSpec:
        block_size: int
        num_kv_heads: int
        head_size: int
        dtype: Any
        sliding_window: int | None = None

    class FullAttentionSpec(AttentionSpec):
        pass

    class MLAAttentionSpec(AttentionSpec):
        pass

    @dc
    class KVCacheGroupSpec:
        layer_names: list
        kv_cache_spec: Any

    @dc
    class KVCacheConfig:
        num_blocks: int
        kv_cache_tensors: list
        kv_cache_groups: list

    for c in (AttentionSpec, FullAttentionSpec, MLAAttentionSpec, KVCacheGroupSpec,
              KVCacheConfig):
        setattr(kvi, c.__name__, c)


def _stub_side_channel() -> None:
    """The gRPC side channel's client module (grpc is not on the GPU machine): the loader gets
    fake clients below, the worker only builds a pool."""
    m = types.ModuleType("turbowire.connector.sidechannel.client")

    class ClientPool:
        @classmethod
        def from_config(cls, config: Any) -> ClientPool:
            return cls()

        def __init__(self, *a: Any, **k: Any) -> None:
            pass

        def get(self, host: str, port: int) -> Any:
            raise RuntimeError("the benchmark installs fake clients")

        def close(self) -> None:
            pass

    m.ClientPool = ClientPool
    m.PeerInfo = SimpleNamespace
    sys.modules[m.__name__] = m


def bootstrap() -> str:
    """Import turbowire (installed, else from this tree); returns how."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        _stub_vllm()
    try:
        import turbowire.connector.worker  # noqa: F401

        how = "installed"
    except ImportError:
        for name in [n for n in sys.modules if n == "turbowire" or n.startswith("turbowire.")]:
            del sys.modules[name]
        pkg = types.ModuleType("turbowire")
        pkg.__path__ = [str(REPO / "turbowire")]  # type: ignore[attr-defined]
        sys.modules["turbowire"] = pkg
        for name in ("codec", "kernels", "connector"):
            spec = importlib.util.spec_from_file_location(
                f"turbowire.{name}", REPO / name / "__init__.py",
                submodule_search_locations=[str(REPO / name)])
            assert spec is not None and spec.loader is not None
            m = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = m
            setattr(pkg, name, m)
            spec.loader.exec_module(m)
        how = "source tree"
    try:
        import grpc  # noqa: F401

        import turbowire.connector.sidechannel.client  # noqa: F401
    except ImportError:
        _stub_side_channel()
    return how


HOW = bootstrap()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from turbowire.codec import Codec  # noqa: E402
from turbowire.connector import worker as worker_mod  # noqa: E402
from turbowire.connector.config import TurboWireConfig  # noqa: E402
from turbowire.connector.geometry import block_tag  # noqa: E402
from turbowire.connector.loader import ChunkOffsets  # noqa: E402
from turbowire.connector.metadata import (  # noqa: E402
    LoadBlock,
    LoadRequest,
    PeerAddress,
    SaveBlock,
    SaveRequest,
    TurboWireConnectorMetadata,
)
from turbowire.connector.transports.base import TransferState  # noqa: E402
from turbowire.kernels import DecodeItem, EncodeItem, decode_into, encode_into  # noqa: E402
from turbowire.kernels.triton_plans import ChunkSet, DecodeLayersPlan  # noqa: E402

DEVICE = "cpu" if SMOKE else "cuda"
MODEL = dict(layers=32, hidden=4096, inter=14336, q_heads=32, kv_heads=8, head_dim=128)
BLOCK = 16
TOKENS = [4096, 32768]
PRESETS = ["tq4", "k4v3"]
if SMOKE:
    MODEL = dict(layers=3, hidden=256, inter=512, q_heads=2, kv_heads=1, head_dim=128)
    TOKENS = [40]
    PRESETS = ["tq4"]


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------
# stand-ins: vLLM config objects, transport, side-channel clients
# ------------------------------------------------------------------------------------------
def layer_names(n: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


def make_worker(preset: str, role: str, engine_id: str, num_blocks: int, pool_bytes: int,
                layers: int, heads: int, dim: int):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    extra = {"preset": preset, "staging_bytes": pool_bytes, "recv_bytes": pool_bytes,
             "decode_pipeline_groups": 8}
    ktc = SimpleNamespace(kv_connector="TurboWireConnector", kv_role=role,
                          kv_connector_extra_config=extra, engine_id=engine_id,
                          is_kv_producer=role in ("kv_producer", "kv_both"),
                          is_kv_consumer=role in ("kv_consumer", "kv_both"),
                          is_kv_transfer_instance=True)
    vcfg = SimpleNamespace(
        kv_transfer_config=ktc,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_index=0),
        model_config=SimpleNamespace(model="/m/Llama-3.1-8B", served_model_name="llama"),
        speculative_config=None, compilation_config=SimpleNamespace(static_forward_context={}))
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=dim,
                             dtype=torch.bfloat16)
    kcfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(layer_names(layers), spec)])
    cfg = TurboWireConfig.from_extra_config(extra, environ={})
    return worker_mod.TurboWireWorker(vcfg, kcfg, cfg, engine_id)


class FakeTransfer:
    def __init__(self, rows: int, transport: FakeTransport) -> None:
        self.rows = rows  # descriptors (chunks) of the READ
        self.transport = transport
        self.index = transport.posted
        transport.posted += 1

    def state(self) -> TransferState:
        # the bytes are in the receive buffer already: the READ has "landed" unless held
        t = self.transport
        held = t.hold or (t.hold_from is not None and self.index >= t.hold_from)
        return TransferState.PENDING if held else TransferState.DONE

    def release(self) -> None:
        pass


class FakeTransport:
    name = "fake"
    agent_name = "bench-agent"
    hold = False  # READs stay PENDING while set (the bench lands them all at one instant)
    hold_from: int | None = None  # READs posted from this count on stay PENDING while set
    posted = 0

    def register(self, tensor: Any) -> None:
        pass

    def local_metadata(self) -> bytes:
        return b""

    def add_peer(self, metadata: bytes) -> str:
        return "prefill-agent"

    def read(self, peer: str, local: Any, remote: Any, mem_type: str, notif: bytes = b""):
        return FakeTransfer(len(local), self)  # O(1): the fake's cost is not the path's

    def close(self) -> None:
        pass


class FakeClient:
    def __init__(self, prefill) -> None:
        self.p = prefill

    def handshake(self, record: Any, engine_id: str, tp_rank: int):
        p = self.p
        staging = SimpleNamespace(
            agent_name="prefill-agent", agent_metadata=b"", base_addr=p.staging.data_ptr(),
            slot_bytes=p.layout.slot_bytes, num_slots=p.layout.num_slots,
            layer_offsets=tuple(p.layout.layer_offsets), device_id=0, mem_type=p.mem_type)
        return SimpleNamespace(engine_id="prefill", record=p.record, staging=staging,
                               lease_seconds=30.0)

    def heartbeat(self, ids: list[str], engine_id: str = "", **kw: Any):
        return SimpleNamespace(unknown=[], refused=[])  # kw: lease_tokens

    def release(self, ids: list[str], engine_id: str = "", tp_rank: int = 0, **kw: Any):
        return SimpleNamespace(unknown=[], refused=[])


class InlineExecutor:
    """Runs the loader's side-channel calls inline (their network time is not the path's)."""

    def submit(self, fn, *args, **kwargs):
        from concurrent.futures import Future

        f: Future = Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001
            f.set_exception(exc)
        return f


worker_mod.make_transport = lambda config, name: FakeTransport()  # no NIXL here


def wire_loader(d, p) -> None:
    client = FakeClient(p)
    d.loader._clients = SimpleNamespace(get=lambda host, port: client)
    d.loader._executor = InlineExecutor()


# ------------------------------------------------------------------------------------------
# requests
# ------------------------------------------------------------------------------------------
def save_meta(rid: str, block_ids: list[int], ntok: int, slot0: int = 0):
    blocks = []
    for i in range((ntok + BLOCK - 1) // BLOCK):
        blocks.append(SaveBlock(i, block_ids[i], min(BLOCK, ntok - i * BLOCK), slot0 + i,
                                block_tag(rid, i)))
    return TurboWireConnectorMetadata(saves=[SaveRequest(rid, list(block_ids), blocks)])


def load_meta(rid: str, remote: str, save: SaveRequest, block_ids: list[int], preset: str):
    peer = PeerAddress("prefill", "127.0.0.1", 1, 1)
    blocks = [LoadBlock(b.index, block_ids[b.index], b.num_tokens, b.slot, b.tag)
              for b in save.blocks]
    return TurboWireConnectorMetadata(loads=[LoadRequest(rid, remote, peer, blocks, preset,
                                                         list(block_ids))])


def fill_recv(d, p, save: SaveRequest, offset: int = 0) -> ChunkOffsets:
    """Put the request's chunks into the decode worker's receive buffer where its loader will
    READ them (layer-major, blocks in order), with one strided copy per (layer, size class)."""
    n_l = p.geometry.num_layers
    sizes = np.array([[p.chunk_nbytes(layer, b.num_tokens, b.index) for b in save.blocks]
                      for layer in range(n_l)], dtype=np.int64)
    flat = sizes.reshape(-1)
    offs = (np.cumsum(flat) - flat).reshape(sizes.shape)
    slots = [b.slot for b in save.blocks]
    slot_bytes = p.layout.slot_bytes
    st = p.staging
    for layer in range(n_l):
        lo = p.layout.layer_offsets[layer]
        i = 0
        while i < len(slots):
            j = i
            while (j + 1 < len(slots) and sizes[layer, j + 1] == sizes[layer, i]
                   and slots[j + 1] == slots[j] + 1):
                j += 1
            k, size = j - i + 1, int(sizes[layer, i])
            src = st[slots[i] * slot_bytes:(slots[j] + 1) * slot_bytes].view(k, slot_bytes)
            dst_at = offset + int(offs[layer, i])
            d.recv[dst_at:dst_at + k * size].view(k, size).copy_(src[:, lo:lo + size])
            i = j + 1
    return ChunkOffsets(offs, sizes)


# ------------------------------------------------------------------------------------------
# 1. bit-exactness of the connector path vs the reference codec, on this device
# ------------------------------------------------------------------------------------------
def connector_check(preset: str, log) -> dict[str, Any]:
    """A small model (4 layers, 8 KV heads, hd128), two requests (one partial block, one
    starting mid-sequence), per-layer and batched saves, loads in 2 groups."""
    out: dict[str, Any] = {"preset": preset}
    layers, heads, dim, nb = (3, 1, 128, 64) if SMOKE else (4, 8, 128, 64)
    ntok_a, ntok_b = (40, 60) if SMOKE else (300, 200)
    names = layer_names(layers)
    g = torch.Generator(device=DEVICE).manual_seed(11)
    src = {n: (torch.randn(2, nb, BLOCK, heads, dim, generator=g, device=DEVICE) * 1.5
               + torch.linspace(-2, 2, dim, device=DEVICE)).to(torch.bfloat16) for n in names}
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(3)).tolist()
    ids_a, ids_b = perm[:20], perm[20:40]
    meta = save_meta("a", ids_a, ntok_a)
    mb = save_meta("b", ids_b, ntok_b, slot0=len(meta.saves[0].blocks))
    sb = mb.saves[0]
    sb.blocks = sb.blocks[2:]  # "b" computed its first 2 blocks in an earlier step
    meta.saves.append(sb)
    stagings = {}
    for mode in ("layer", "batched"):
        p = make_worker(preset, "kv_producer", f"P-check-{mode}", nb, 8 << 20, layers, heads, dim)
        p.register_kv_caches(src)
        assert p.gpu is not None or SMOKE, "the GPU path must serve CUDA caches"
        if SMOKE:
            from turbowire.connector import gpu_path

            p.gpu = gpu_path.GpuPaths(p.codec, p.geometry, p.layout, p.caches, p.staging, None,
                                      p.chunk_nbytes)
        p.gpu.mode = mode
        for name in names[:-1]:  # the last layer is left to wait_for_save
            p.save_kv_layer(name, src[name], meta)
        p.wait_for_save(meta)
        sync()
        stagings[mode] = p
    p = stagings["layer"]
    ref = torch.zeros_like(p.staging)
    bad = []
    for layer, name in enumerate(names):
        items = [EncodeItem(s.block_ids, b.index * BLOCK, b.num_tokens,
                            p.layout.chunk_offset(b.slot, layer), b.tag)
                 for s in meta.saves for b in s.blocks]
        written = encode_into(p.codec, layer, src[name], p.caches.layouts[layer], items, ref,
                              impl="reference")
        for it, n in zip(items, written):
            for mode, w in stagings.items():
                a = w.staging[it.out_offset:it.out_offset + n]
                if not torch.equal(a, ref[it.out_offset:it.out_offset + n]):
                    bad.append(f"{mode} layer {layer} token {it.token_start}")
    out["encode_bitexact"] = not bad
    out["encode_mismatch"] = bad[:4]
    # decode request "a" (and then a corrupt copy) through the decode worker's loader
    d = make_worker(preset, "kv_consumer", "D-check", nb, 8 << 20, layers, heads, dim)
    dst = {n: torch.full((2, nb, BLOCK, heads, dim), 7.0, device=DEVICE).to(torch.bfloat16)
           for n in names}
    d.register_kv_caches(dst)
    if SMOKE:
        from turbowire.connector import gpu_path

        d.gpu = gpu_path.GpuPaths(d.codec, d.geometry, d.layout, d.caches, None, d.recv,
                                  d.chunk_nbytes)
    d.config = _with_groups(d.config, 2)
    d.loader.config = d.config
    wire_loader(d, p)
    save = meta.saves[0]
    dids = perm[40:60]
    offsets = fill_recv(d, p, save)
    lm = load_meta("da", "a", save, dids, preset)
    d.start_load_kv(lm)
    fin, failed = _drain(d)
    ref_dst = {n: torch.full_like(dst[n], 7.0) for n in names}
    for layer, name in enumerate(names):
        items = [DecodeItem(dids, b.index * BLOCK, b.num_tokens, offsets[(bi, layer)][0],
                            offsets[(bi, layer)][1], b.tag) for bi, b in enumerate(save.blocks)]
        decode_into(d.codec, layer, ref_dst[name], d.caches.layouts[layer], items, d.recv,
                    impl="reference")
    out["load_finished"] = fin == {"da"} and not failed
    out["decode_bitexact"] = all(torch.equal(dst[n], ref_dst[n]) for n in names)
    # corrupt a body byte of the last layer's block 1, in a group of several chunks (layers 2,
    # 3 x every block): the load fails (the whole request: vLLM recomputes its blocks), nothing
    # of that chunk is written, the group's other chunks are, as the reference decodes them
    # (each program verifies the chunk it decodes); other groups: decoded or untouched
    at = offsets[(1, layers - 1)][0] + 100
    d.recv[at] ^= 0x40
    for n in names:
        dst[n].fill_(7.0)
    d.start_load_kv(load_meta("db", "a", save, dids, preset))
    fin, failed = _drain(d)
    report = d.take_reports().reports.get("db")
    out["corruption_refused"] = (failed == {"db"} and report is not None
                                 and report.failed == "checksum")
    blk = save.blocks[1]
    rows = (slice(None), dids[blk.index], slice(0, blk.num_tokens))
    out["corrupt_chunk_untouched"] = bool((dst[names[-1]][rows].float() == 7.0).all())
    group_of_last = [g for g in _groups(layers, 2) if layers - 1 in g][0]
    want = {n: ref_dst[n].clone() for n in names}
    want[names[-1]][rows] = 7.0
    out["corrupt_group_others_equal_reference"] = all(
        torch.equal(dst[names[i]], want[names[i]]) for i in group_of_last)
    out["other_groups_reference_or_untouched"] = all(
        bool(((dst[n] == ref_dst[n]) | (dst[n].float() == 7.0)).all()) for n in names)
    out["ok"] = bool(out["encode_bitexact"] and out["load_finished"] and out["decode_bitexact"]
                     and out["corruption_refused"] and out["corrupt_chunk_untouched"]
                     and out["corrupt_group_others_equal_reference"]
                     and out["other_groups_reference_or_untouched"])
    log(f"[connector check] {preset}: {json.dumps(out)}")
    for w in (*stagings.values(), d):
        w.shutdown()
    return out


class MemStore:
    """An in-memory chunk store (the LMCache tiers' put/get)."""

    def __init__(self) -> None:
        self.blobs: dict[tuple[bytes, int], bytes] = {}

    def put(self, scope: Any, chunk_hash: bytes, rank: int, data: bytes, on_done=None) -> bool:
        self.blobs[(chunk_hash, rank)] = bytes(data)
        if on_done is not None:
            on_done(True, None)
        return True

    def get(self, scope: Any, chunk_hash: bytes, rank: int) -> bytes | None:
        return self.blobs.get((chunk_hash, rank))

    def close(self) -> None:
        pass


def store_check(preset: str, log) -> dict[str, Any]:
    """The store path's save (wait_for_save): every chunk of a step encoded on a side stream and
    copied to pinned memory there, stored by a background thread; the blobs must equal the
    chunk-by-chunk path's."""
    import hashlib

    from turbowire.connector.metadata import StoreChunk, StoreSave
    from turbowire.connector.stats import TurboWireConnectorStats
    from turbowire.connector.store_worker import StoreWorker
    from turbowire.store.keys import StoreScope

    layers, heads, dim, nb = (3, 1, 128, 32) if SMOKE else (4, 8, 128, 64)
    chunk = 32 if SMOKE else 256
    names = layer_names(layers)
    g = torch.Generator(device=DEVICE).manual_seed(13)
    src = {n: torch.randn(2, nb, BLOCK, heads, dim, generator=g, device=DEVICE)
           .to(torch.bfloat16) for n in names}
    p = make_worker(preset, "kv_producer", f"P-store-{preset}", nb, 8 << 20, layers, heads, dim)
    p.register_kv_caches(src)
    ids = torch.randperm(nb, generator=torch.Generator().manual_seed(2)).tolist()
    cfg = TurboWireConfig(transport="store", store_chunk_tokens=chunk, preset=preset)
    scope = StoreScope("bench", "llama", preset, 1, chunk, 1)
    starts = [0, chunk, 3 * chunk] if not SMOKE else [0, chunk]
    saves = [StoreSave("r", ids, [StoreChunk(t, hashlib.sha256(str(t).encode()).digest()[:16])
                                  for t in starts])]
    blobs = []
    out: dict[str, Any] = {"preset": preset}
    for side in (True, False):
        st = MemStore()
        w = StoreWorker(cfg, p.geometry, p.codec, scope, 0, p.caches, TurboWireConnectorStats(),
                        store=st, directory=None)
        t0 = time.perf_counter()
        if side:
            w.save(saves)
            out["side_stream_path"] = bool(w._gpu_saves)
            out["engine_thread_ms"] = (time.perf_counter() - t0) * 1e3
        else:
            w._save_each(saves)
        w.close()  # waits for the background stores
        blobs.append(st.blobs)
    out["blobs"] = len(blobs[0])
    out["ok"] = bool(blobs[0] == blobs[1] and len(blobs[0]) == len(starts))
    log(f"[store check] {preset}: {json.dumps(out)}")
    p.shutdown()
    return out


def _groups(layers: int, groups: int) -> list[range]:
    from turbowire.connector.loader import layer_groups

    return layer_groups(layers, groups)


def _with_groups(config: TurboWireConfig, groups: int) -> TurboWireConfig:
    import dataclasses

    return dataclasses.replace(config, decode_pipeline_groups=groups)


def _drain(d, limit: float = 60.0) -> tuple[set[str], set[str]]:
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
# 2. prefill: stand-in forward with the save path
# ------------------------------------------------------------------------------------------
@dataclass
class Forward:
    """bf16 matmuls of one Llama-3.1-8B layer (weights shared by the layers: they are far
    larger than L2 either way) and the layer's KV write into the paged cache."""

    tokens: int
    caches: dict[str, torch.Tensor]
    slot_mapping: torch.Tensor
    w: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        h, i = MODEL["hidden"], MODEL["inter"]
        kv = MODEL["kv_heads"] * MODEL["head_dim"]
        g = torch.Generator(device=DEVICE).manual_seed(1)

        def weight(a: int, b: int) -> torch.Tensor:
            return (torch.randn(a, b, generator=g, device=DEVICE) / a ** 0.5).to(torch.bfloat16)

        self.w = {"qkv": weight(h, h + 2 * kv), "o": weight(h, h), "gu": weight(h, 2 * i),
                  "d": weight(i, h)}
        self.x0 = torch.randn(self.tokens, h, generator=g, device=DEVICE).to(torch.bfloat16)

    def run(self, worker, meta) -> None:
        h = MODEL["hidden"]
        kvh, hd = MODEL["kv_heads"], MODEL["head_dim"]
        kv = kvh * hd
        x = self.x0
        for name, cache in self.caches.items():
            qkv = x @ self.w["qkv"]
            k = qkv[:, h:h + kv].reshape(-1, kvh, hd)
            v = qkv[:, h + kv:].reshape(-1, kvh, hd)
            # vLLM's reshape_and_cache: token t into slot_mapping[t] of the layer's paged cache
            cache[0].view(-1, kvh, hd).index_copy_(0, self.slot_mapping, k)
            cache[1].view(-1, kvh, hd).index_copy_(0, self.slot_mapping, v)
            if worker is not None:
                worker.save_kv_layer(name, cache, meta)  # vLLM: at the end of the attention op
            o = qkv[:, :h] @ self.w["o"]
            gu = o @ self.w["gu"]
            x = gu[:, :MODEL["inter"]] @ self.w["d"]
        if worker is not None:
            worker.wait_for_save(meta)


def freeze_gc_heap() -> None:
    """What vLLM's EngineCore does once it has started (vllm.utils.gc_utils.freeze_gc_heap):
    everything alive goes to the oldest generation and is frozen, so a collection during
    serving does not walk the engine's start-up heap (here: models, caches, plans, kernels)."""
    gc.collect(0)
    gc.collect(1)
    gc.collect(2)
    gc.freeze()


def time_step(fn, iters: int) -> list[float]:
    """ms per call, CUDA events on the current stream around fn (which includes
    wait_for_save's join), a host sync after each call (the step boundary)."""
    out = []
    for _ in range(iters):
        if DEVICE == "cuda":
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return out


def bench_ms(fn) -> float:
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


# launch shapes tried for the connector's block-sized chunks (16 tokens): the default tiles are
# 32 rows (4 warps x 32 threads / 4 lanes per row), half of them empty for a 16-token chunk
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "w2-t16": dict(num_warps=2, tile_rows=16),
    "w1-t16": dict(num_warps=1, tile_rows=16),
    "w2-t16-q2": dict(num_warps=2, tile_rows=16, qmode=2),  # bucketed-table quantizer
    "w2-t16-q0": dict(num_warps=2, tile_rows=16, qmode=0),  # binary search
    "w2-t16-l8": dict(num_warps=2, tile_rows=16, lanes=8),  # 16 coordinates per thread
    "w2-t16-nocap": dict(num_warps=2, tile_rows=16, encode_max_registers=None),
}
BEST: dict[str, tuple[str, str]] = {}  # preset -> (encode config, decode config), from 4k
SWEEP = False  # --sweep: time the launch shapes above (they compile; a minute per preset)
TRACE = False  # --trace: a torch.profiler timeline of one step per save variant, summarised
PROFILE_LOAD = False  # --profile-load: cProfile of one load's landed -> finished
TRACE_LOAD = False  # --trace-load: torch.profiler timeline of held loads, steps marked
ENCODE_CAP = 0  # --encode-cap N: a save variant with the encoder capped at N registers
TIMELINE_LOAD = False  # --load-timeline: perf-counter marks on the load's calls, no profiler
# --decode-variants: other launch shapes of the one-launch decode, timed at <= 8k tokens
DECODE_VARIANTS: dict[str, dict[str, Any]] = {
    "split2": dict(num_warps=2, tile_rows=16, decode_split=2),  # one program per stream
    "w1-t16": dict(num_warps=1, tile_rows=16),
    "w4": dict(num_warps=4),  # the kernels' default shape (32-row tiles)
}
VARIANTS: list[str] = []


def gpu_path_default(block_size: int):
    from turbowire.connector.gpu_path import default_kernel_config

    return default_kernel_config(block_size)


def run_case(tokens: int, preset: str, log, iters: int) -> dict[str, Any]:
    from turbowire.kernels.triton_dispatch import KernelConfig

    r: dict[str, Any] = {"tokens": tokens, "preset": preset}
    layers, heads, dim = MODEL["layers"], MODEL["kv_heads"], MODEL["head_dim"]
    names = layer_names(layers)
    nblk = (tokens + BLOCK - 1) // BLOCK
    nb = nblk + 64
    codec = Codec(preset, dim, layers)
    pool = (sum(codec.encoded_nbytes(i, BLOCK, heads) + 64 for i in range(layers))
            * (nblk + 8))
    g = torch.Generator(device=DEVICE).manual_seed(5)
    src = {n: torch.randn(2, nb, BLOCK, heads, dim, generator=g, device=DEVICE)
           .to(torch.bfloat16) for n in names}
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(7)).tolist()
    p_ids = perm[:nblk]
    d_ids = perm[::-1][:nblk]
    t = torch.arange(tokens)
    slot_mapping = (torch.tensor(p_ids)[t // BLOCK] * BLOCK + t % BLOCK).to(DEVICE)
    p = make_worker(preset, "kv_producer", f"P-{preset}-{tokens}", nb, pool, layers, heads, dim)
    p.register_kv_caches(src)
    d_caches = {n: torch.zeros(2, nb, BLOCK, heads, dim, device=DEVICE, dtype=torch.bfloat16)
                for n in names}
    d = make_worker(preset, "kv_consumer", f"D-{preset}-{tokens}", nb, pool, layers, heads, dim)
    d.register_kv_caches(d_caches)
    if SMOKE:
        from turbowire.connector import gpu_path

        p.gpu = gpu_path.GpuPaths(p.codec, p.geometry, p.layout, p.caches, p.staging, None,
                                  p.chunk_nbytes)
        d.gpu = gpu_path.GpuPaths(d.codec, d.geometry, d.layout, d.caches, None, d.recv,
                                  d.chunk_nbytes)
    wire_loader(d, p)
    fwd = Forward(tokens, src, slot_mapping)
    rid = f"req-{tokens}"

    host_us: list[float] = []
    real_save = p.save_kv_layer

    def timed_save(name, cache, meta):
        t0 = time.perf_counter()
        real_save(name, cache, meta)
        host_us.append((time.perf_counter() - t0) * 1e6)

    side = p.gpu.side
    # the side stream runs at priority 0, the lowest CUDA has (the forward's stream is at 0
    # too): a lower-priority encode stream does not exist; the high-priority one is the contrast
    hi_side = (torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])
               if DEVICE == "cuda" else None)

    save_cfg: list[Any] = [p.gpu.kernel_config]  # the encoder's config of the plain variants
    cap_cfg: Any = None

    def step(variant: str):
        # a new metadata object each step, as vLLM's scheduler sends (made outside the timing)
        meta = save_meta(rid, p_ids, tokens)

        def fn() -> None:
            if variant == "forward":
                fwd.run(None, None)
                return
            p.gpu.mode = "batched" if variant == "batched" else "layer"
            # layer-capN: the per-layer launches with the encoder capped at N registers
            p.gpu.kernel_config = (cap_cfg if variant.startswith("layer-cap") else
                                   save_cfg[0])
            # layer-inline: the per-layer launches on the forward's own stream (no side stream)
            p.gpu.side = (hi_side if variant == "layer-hiprio" else
                          None if variant == "layer-inline" and DEVICE == "cuda" else side)
            if variant == "legacy":  # the pre-plan path: encode_into once per layer
                gpu, p.gpu = p.gpu, None
                try:
                    fwd.run(p, meta)
                finally:
                    p.gpu = gpu
                return
            fwd.run(p, meta)
            if variant == "layer+sync" and DEVICE == "cuda":
                torch.cuda.current_stream().synchronize()
        return fn

    # ---- stage the request (default launch shape), put it in the decode worker's receive
    # buffer, decode it once: the references for the launch shapes tried below (the staging
    # is poisoned first, as before every comparison: padding bytes are never written)
    p.staging.fill_(0xA5)
    step("layer")()
    sync()
    meta = save_meta(rid, p_ids, tokens)
    save = meta.saves[0]
    ref_staging = p.staging.clone()
    offsets = fill_recv(d, p, save)
    dchunks = ChunkSet([d_ids], np.zeros(len(save.blocks), np.int64),
                       [b.index * BLOCK for b in save.blocks],
                       [b.num_tokens for b in save.blocks], [b.tag for b in save.blocks])

    def dplan_for(cfg):
        return DecodeLayersPlan(d.codec, range(layers), d.caches.tensors, d.caches.layouts[0],
                                dchunks, offsets.offsets, offsets.sizes, d.recv, cfg)

    dp = dplan_for(None)
    dp.launch()
    dp.check()
    ref_dst = {n: d_caches[n].clone() for n in names}
    # ---- launch shapes: encode (all layers, one launch) and decode (one launch) per shape
    sweep: dict[str, dict[str, Any]] = {}
    for cname, kw in (CONFIGS.items() if SWEEP and preset not in BEST else ()):
        try:
            cfg = KernelConfig(**kw) if kw else None
            p.gpu.kernel_config = cfg
            st = p.gpu._build_step(save_meta(rid, p_ids, tokens))
            p.staging.fill_(0xA5)
            for pl, _ in st.plans:
                pl.launch()
            dq = dplan_for(cfg)
            for n in names:
                d_caches[n].zero_()
            dq.launch()
            dq.check()
            sync()
            staging_equal = bool(torch.equal(p.staging, ref_staging))
            decode_equal = all(torch.equal(d_caches[n], ref_dst[n]) for n in names)
            sweep[cname] = {
                "encode_ms": bench_ms(lambda: [pl.launch() for pl, _ in st.plans]),
                "decode_ms": bench_ms(dq.launch),
                "staging_equal": staging_equal, "decode_equal": decode_equal,
            }
        except Exception as exc:  # noqa: BLE001 - a shape that does not build is skipped
            sweep[cname] = {"error": repr(exc)[:300], "staging_equal": False,
                            "decode_equal": False}
        log(f"  launch shape {cname}: {sweep[cname]}")
    if sweep:
        ok = {k: v for k, v in sweep.items() if v["staging_equal"] and v["decode_equal"]}
        BEST[preset] = (min(ok, key=lambda k: ok[k]["encode_ms"]),
                        min(ok, key=lambda k: ok[k]["decode_ms"]))
        r["launch_shapes"] = sweep
    if preset in BEST:  # the launch shapes that won above
        enc_name, dec_name = BEST[preset]
        p.gpu.kernel_config = KernelConfig(**CONFIGS[enc_name]) if CONFIGS[enc_name] else None
        d.gpu.kernel_config = KernelConfig(**CONFIGS[dec_name]) if CONFIGS[dec_name] else None
    else:  # the connector's own choice (gpu_path.default_kernel_config)
        p.gpu.kernel_config = gpu_path_default(BLOCK)
        d.gpu.kernel_config = gpu_path_default(BLOCK)
        c = p.gpu.kernel_config
        enc_name = dec_name = ("connector default" if c is None else
                               f"connector default w{c.num_warps}-t{c.tile_rows}")
        if c is not None and isinstance(c.encode_max_registers, int):
            enc_name += f"-r{c.encode_max_registers}"
    r["encode_config"], r["decode_config"] = enc_name, dec_name
    dec_cfg = d.gpu.kernel_config
    save_cfg[0] = p.gpu.kernel_config
    cap_cfg = (dataclasses.replace(save_cfg[0] or KernelConfig(), encode_max_registers=ENCODE_CAP)
               if ENCODE_CAP else None)

    # ---- 2. prefill: forward alone vs forward + save path, paired rounds
    variants = ["layer", "batched", "layer-hiprio", "layer+sync", "layer-inline"]
    if cap_cfg is not None:
        variants.append(f"layer-cap{ENCODE_CAP}")
    for v in ["forward"] + variants + ["legacy"]:  # warm-up: compiled, allocator and plans warm
        step(v)()
    sync()
    freeze_gc_heap()
    p.save_kv_layer = timed_save
    clocks = ClockSampler()
    clocks.start()
    sv = paired_rounds(step, variants, iters)
    clocks.stop()
    p.save_kv_layer = real_save
    p.gpu.kernel_config = save_cfg[0]
    lg = paired_rounds(step, ["legacy"], max(2, iters // 10))
    if TRACE and DEVICE == "cuda":
        r["trace"] = trace_steps(step, ["forward", "layer", "batched", "layer-hiprio"],
                                 f"{tokens}_{preset}", log)
    fw = statistics.median(sv["forward"])
    r["forward_ms"] = fw
    r["spread_forward_ms"] = [min(sv["forward"]), max(sv["forward"])]
    for v, diffs in [*((v, sv["diff"][v]) for v in variants), ("legacy", lg["diff"]["legacy"])]:
        add = statistics.median(diffs)
        lo, hi = bootstrap_median(diffs)
        r[f"{v}_ms"] = fw + add
        r[f"{v}_pct"] = 100 * add / fw
        r[f"{v}_pct_ci95"] = [100 * lo / fw, 100 * hi / fw]
    aa = sv["aa"]
    r["aa_pct"] = 100 * statistics.median(aa) / fw
    r["aa_pct_ci95"] = [100 * x / fw for x in bootstrap_median(aa)]
    r["aa_pct_iqr"] = [100 * float(np.percentile(aa, q)) / fw for q in (25, 75)]
    r["rounds"] = iters
    r["clocks"] = clocks.summary()
    r["host_us_per_save_kv_layer"] = statistics.median(host_us) if host_us else None
    r["host_us_mean_save_kv_layer"] = statistics.mean(host_us) if host_us else None
    r["host_us_max_save_kv_layer"] = max(host_us) if host_us else None
    r["host_us_first_save_kv_layer"] = (statistics.median(host_us[::layers])
                                        if host_us else None)
    r["stream_priority_range"] = (list(torch.cuda.Stream.priority_range())
                                  if DEVICE == "cuda" else None)
    # the encode kernels alone: the step plan's one launch per policy, all layers
    builds = []
    for _ in range(3):
        m = save_meta(rid, p_ids, tokens)
        t0 = time.perf_counter()
        plan_step = p.gpu._build_step(m)
        builds.append((time.perf_counter() - t0) * 1e3)
    r["host_ms_step_plan_build"] = statistics.median(builds)
    r["encode_one_launch_ms"] = bench_ms(lambda: [pl.launch() for pl, _ in plan_step.plans])
    if cap_cfg is not None:  # the same with the encoder capped (compiled by the rounds above)
        p.gpu.kernel_config = cap_cfg
        cap_step = p.gpu._build_step(save_meta(rid, p_ids, tokens))
        p.gpu.kernel_config = save_cfg[0]
        r["encode_one_launch_cap_ms"] = bench_ms(
            lambda: [pl.launch() for pl, _ in cap_step.plans])
        r["encode_per_layer_launches_cap_ms"] = bench_ms(
            lambda: [pl.launch_layer(i) for pl, fam in cap_step.plans for i in range(len(fam))])
        log(f"  encoder capped at {ENCODE_CAP} registers: one launch "
            f"{r['encode_one_launch_cap_ms']:.3f} ms, per-layer "
            f"{r['encode_per_layer_launches_cap_ms']:.3f} ms")
    r["encode_per_layer_launches_ms"] = bench_ms(
        lambda: [pl.launch_layer(i) for pl, fam in plan_step.plans for i in range(len(fam))])
    r["encode_pct_of_forward"] = 100 * r["encode_one_launch_ms"] / fw
    r["wire_MB"] = plan_step.wire_bytes / 1e6
    r["dense_MB"] = tokens * p.caches.dense_bytes_per_token() / 1e6
    r["graph"] = graph_probe(plan_step, log)
    # staging bytes equal across the per-layer, batched, high-priority and legacy paths
    stg = []
    for v in ("layer", "batched", "layer-hiprio", "legacy", "layer-inline", *variants[5:]):
        p.staging.fill_(0xA5)
        step(v)()
        sync()
        stg.append(bool(torch.equal(ref_staging, p.staging)))
    r["staging_equal_layer_batched_hiprio_legacy"] = stg
    r["reference_spot_check"] = spot_check(p, d, save, offsets, names, src, d_caches, p_ids,
                                           d_ids, ref_staging, ref_dst)
    del ref_staging

    # ---- 3. the decode side: the same request through the decode worker's loader
    fill_recv(d, p, save)
    transport = d.transport
    flushes: list[tuple[float, float]] = []
    real_flush = d.gpu._flush

    gpu_marks: list[tuple[Any, Any]] = []  # timing events around each flush: its GPU time
    mark_gpu = [False]  # only in loads of their own: the events' records are host time too

    def timed_flush(entry):
        t0 = time.perf_counter()
        e0 = None
        if mark_gpu[0]:
            e0 = torch.cuda.Event(enable_timing=True)
            e0.record()
        try:
            real_flush(entry)
        finally:
            if e0 is not None:
                e1 = torch.cuda.Event(enable_timing=True)
                e1.record()
                gpu_marks.append((e0, e1))
            flushes.append((t0, time.perf_counter()))

    d.gpu._flush = timed_flush
    replays: list[float] = []
    real_replay = torch.cuda.CUDAGraph.replay

    replay_starts: list[float] = []

    def timed_replay(graph) -> None:
        t0 = time.perf_counter()
        replay_starts.append(t0)
        real_replay(graph)
        replays.append(time.perf_counter() - t0)

    torch.cuda.CUDAGraph.replay = timed_replay
    waits: list[tuple[float, float]] = []  # the verdict's event waits: (entered, returned)
    real_sync = torch.cuda.Event.synchronize

    def timed_sync(event) -> None:
        t0 = time.perf_counter()
        real_sync(event)
        waits.append((t0, time.perf_counter()))

    torch.cuda.Event.synchronize = timed_sync

    gc_pauses: list[tuple[float, float]] = []  # the cyclic collector's runs: (start, stop)
    gc_started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            gc_pauses.append((gc_started[0], time.perf_counter()))

    gc.callbacks.append(on_gc)

    def load_once(i: int, hold: bool, two_polls: bool = False) -> dict[str, float]:
        """hold: the READs are posted and stay on the "wire" until every one lands at once;
        else they are done when posted (start_load_kv does everything). two_polls: the first
        two READs land, one poll (it posts the rest in one READ), then the rest lands."""
        lm = load_meta(f"d{i}", rid, save, d_ids, preset)
        sync()
        flushes.clear()
        replays.clear()
        replay_starts.clear()
        waits.clear()
        gpu_marks.clear()
        transport.hold = hold
        first = transport.posted
        t0 = time.perf_counter()
        d.start_load_kv(lm)
        t1 = time.perf_counter()
        if two_polls:
            transport.hold_from = first + 2
        transport.hold = False
        t2 = time.perf_counter()
        fin, failed = set(), set()
        if two_polls:
            f, x = d.get_transfer_results()
            fin |= f
            failed |= x
            transport.hold_from = None
        while f"d{i}" not in fin:
            f, x = d.get_transfer_results()
            fin |= f
            failed |= x
        t3 = time.perf_counter()
        if failed:
            raise RuntimeError(f"load failed: {d.take_reports().reports}")
        # the engine's next step (vLLM polls every step): the finished load's lease release and
        # metrics go out there, not inside the next load's window
        d.get_transfer_results()
        rep = d.take_reports().reports[f"d{i}"]
        out = {"post": (t1 - t0) * 1e3, "landed": (t3 - t2) * 1e3, "total": (t3 - t0) * 1e3,
               "decode": rep.decode_seconds * 1e3, "launches": len(flushes)}
        if flushes:
            base = t2 if hold else t0
            out["to_first_launch"] = (flushes[0][0] - base) * 1e3
            out["launch_host"] = sum(b - a for a, b in flushes) * 1e3
            out["after_last_launch"] = (t3 - flushes[-1][1]) * 1e3
        out["replays"] = len(replays)
        if replays:
            out["replay_host"] = sum(replays) * 1e3
            base = t2 if hold else t0
            out["to_first_replay"] = (replay_starts[0] - base) * 1e3
        in_window = [(a, b) for a, b in gc_pauses if a >= t2]
        out["gc_ms"] = sum(b - a for a, b in in_window) * 1e3  # collections inside the window
        gc_pauses.clear()
        if waits:  # host time after the last verdict came back (bookkeeping, report)
            out["after_verdict"] = (t3 - waits[-1][1]) * 1e3
            out["verdict_wait"] = sum(b - a for a, b in waits) * 1e3
            out["verdict_back"] = (waits[-1][1] - (t2 if hold else t0)) * 1e3
        if gpu_marks:  # GPU time from the first flush's start to the last's end
            real_sync(gpu_marks[-1][1])
            out["launch_gpu"] = gpu_marks[0][0].elapsed_time(gpu_marks[-1][1])
        return out

    for i in range(3):
        load_once(-1 - i, True)  # handshake, compile, warm
        load_once(-10 - i, False)
    freeze_gc_heap()  # what was built up to here lives as long as an engine's start-up heap
    n_loads = 2 if SMOKE else max(8, min(iters, 20))
    loaded = torch.tensor(d_ids, device=DEVICE)
    replays0 = d.gpu.graph_replays
    last = save.blocks[-1]
    last_id, last_nt = d_ids[last.index], last.num_tokens

    def poison(caches, ref) -> None:  # the rows a load writes; a partial block's tail is kept
        for n in names:
            caches[n][:, loaded] = 7.0
            caches[n][:, last_id, last_nt:] = ref[n][:, last_id, last_nt:]

    poison(d_caches, ref_dst)
    held = [load_once(i, True) for i in range(n_loads)]
    mark_gpu[0] = torch.cuda.is_available()  # the GPU time of the launches, in loads of their own
    marked = [load_once(50 + i, True) for i in range(min(n_loads, 8))]
    mark_gpu[0] = False
    r["load_graph_replays"] = d.gpu.graph_replays - replays0
    r["decode_equal_graph_loads"] = all(torch.equal(d_caches[n], ref_dst[n]) for n in names)
    now = [load_once(100 + i, False) for i in range(n_loads)]
    eager_default = d.gpu.eager_groups
    d.gpu.eager_groups = False  # launch deferred to the first ask (pass 4's default)
    poison(d_caches, ref_dst)
    eager = [load_once(300 + i, True) for i in range(n_loads)]
    r["decode_equal_eager_loads"] = all(torch.equal(d_caches[n], ref_dst[n]) for n in names)
    d.gpu.eager_groups = eager_default
    d.gpu.decode_graphs = False  # the same without the captured launch: Triton launches
    poison(d_caches, ref_dst)
    direct = [load_once(200 + i, True) for i in range(n_loads)]
    r["decode_equal_direct_loads"] = all(torch.equal(d_caches[n], ref_dst[n]) for n in names)
    d.gpu.decode_graphs = True
    d.loader.merge_landed = False  # one decode call per landed READ (passes 1-4)
    poison(d_caches, ref_dst)
    per_group = [load_once(400 + i, True) for i in range(n_loads)]
    r["decode_equal_per_group_loads"] = all(torch.equal(d_caches[n], ref_dst[n]) for n in names)
    d.loader.merge_landed = True
    poison(d_caches, ref_dst)  # the first two READs land, a poll, then the rest: two runs
    two_polls = [load_once(600 + i, True, two_polls=True) for i in range(n_loads)]
    r["decode_equal_two_poll_loads"] = all(torch.equal(d_caches[n], ref_dst[n]) for n in names)
    d.loader.coalesce_idle = False  # two READs in flight to the end (pass 6): 6 posts at landing
    poison(d_caches, ref_dst)
    pairwise = [load_once(500 + i, True) for i in range(n_loads)]
    r["decode_equal_pairwise_loads"] = all(torch.equal(d_caches[n], ref_dst[n]) for n in names)
    d.loader.coalesce_idle = True
    if TRACE_LOAD:
        poison(d_caches, ref_dst)
        r["load_trace"] = trace_load(d, lambda i: load_meta(f"t{i}", rid, save, d_ids, preset),
                                     f"{tokens}_{preset}", log)
        r["decode_equal_traced_loads"] = all(torch.equal(d_caches[n], ref_dst[n])
                                             for n in names)
    if TIMELINE_LOAD:
        poison(d_caches, ref_dst)
        r["load_timeline"] = timeline_load(
            d, lambda i: load_meta(f"t{i}", rid, save, d_ids, preset), f"{tokens}_{preset}",
            log)
        r["decode_equal_timeline_loads"] = all(torch.equal(d_caches[n], ref_dst[n])
                                               for n in names)
    if PROFILE_LOAD:  # where the host time of one landed -> finished goes
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        lm = load_meta("prof", rid, save, d_ids, preset)
        sync()
        transport.hold = True
        d.start_load_kv(lm)
        transport.hold = False
        prof.enable()
        fin: set[str] = set()
        while "prof" not in fin:
            fin |= d.get_transfer_results()[0]
        prof.disable()
        d.take_reports()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
        log("  cProfile of one landed -> finished (graphs on):\n" + buf.getvalue()[-3500:])
    d.gpu._flush = real_flush
    torch.cuda.CUDAGraph.replay = real_replay
    torch.cuda.Event.synchronize = real_sync
    gc.callbacks.remove(on_gc)

    def med(rows, key):
        vals = [x[key] for x in rows if key in x]
        return statistics.median(vals) if vals else None

    r["load_ms"] = med(held, "landed")  # bytes landed -> finished: the path's own cost
    r["load_post_ms"] = med(held, "post")  # start_load_kv: READs posted, decode plan built
    r["load_to_first_launch_ms"] = med(held, "to_first_launch")
    r["load_launch_host_ms"] = med(held, "launch_host")
    r["load_after_last_launch_ms"] = med(held, "after_last_launch")
    r["load_launches"] = med(held, "launches")  # flushes: one per group replayed
    r["load_replay_host_ms"] = med(held, "replay_host")  # inside the flushes: graph replays
    r["load_to_first_replay_ms"] = med(held, "to_first_replay")  # landed -> GPU work queued
    r["load_launch_gpu_ms"] = med(marked, "launch_gpu")  # GPU: first flush start -> last end
    r["load_marked_ms"] = med(marked, "landed")  # the same loads, timing events recorded too
    r["load_verdict_wait_ms"] = med(held, "verdict_wait")  # host blocked on the verdict
    r["load_after_verdict_ms"] = med(held, "after_verdict")  # verdict back -> reported
    r["load_verdict_back_ms"] = med(held, "verdict_back")  # landed -> the verdict's wait returned
    r["load_gc_ms"] = [round(max(x.get("gc_ms", 0) for x in held), 3),
                       sum(1 for x in held if x.get("gc_ms", 0) > 0)]  # worst, loads with one
    r["load_decode_groups_ms"] = med(held, "decode")
    r["load_all_at_once_ms"] = med(now, "total")  # READs done when posted: plan build included
    r["load_all_at_once_launches"] = med(now, "launches")
    r["load_deferred_launch_ms"] = med(eager, "landed")
    r["load_deferred_launch_launches"] = med(eager, "launches")
    r["load_no_graph_ms"] = med(direct, "landed")
    r["load_per_group_ms"] = med(per_group, "landed")
    r["load_per_group_launches"] = med(per_group, "launches")
    r["load_pairwise_reads_ms"] = med(pairwise, "landed")
    r["load_two_polls_ms"] = med(two_polls, "landed")
    r["load_two_polls_launches"] = med(two_polls, "launches")
    r["load_two_polls_replays"] = statistics.median(x.get("replays", 0) for x in two_polls)
    r["load_pairwise_to_first_replay_ms"] = med(pairwise, "to_first_replay")
    r["load_no_graph_launch_host_ms"] = med(direct, "launch_host")
    r["load_spread_ms"] = [min(x["landed"] for x in held), max(x["landed"] for x in held)]
    r["decode_equal_reference_shape"] = all(torch.equal(d_caches[n], ref_dst[n]) for n in names)
    builds = []
    for _ in range(3):
        t0 = time.perf_counter()
        dplan = dplan_for(dec_cfg)
        builds.append((time.perf_counter() - t0) * 1e3)
    r["host_ms_load_plan_build"] = statistics.median(builds)
    t0 = time.perf_counter()
    d.loader._chunk_sizes(load_meta("x", rid, save, d_ids, preset).loads[0])
    r["host_ms_loader_chunk_sizes"] = (time.perf_counter() - t0) * 1e3
    # the one-launch decode of the same bytes (the fused verify + decode of every chunk, one
    # launch per layer policy, no readback)
    dplan.launch()
    dplan.check()
    r["decode_one_launch_ms"] = bench_ms(dplan.launch)
    sync()
    t0 = time.perf_counter()
    for _ in range(20):
        dplan.launch()
    # (the name is kept from the two-launch decode: host time of one plan launch, all layers)
    r["host_us_decode_launch_pair"] = (time.perf_counter() - t0) / 20 * 1e6
    sync()
    if VARIANTS and tokens <= 8192:  # other launch shapes of the one-launch decode
        r["decode_variants"] = {}
        for name in VARIANTS:
            try:
                vplan = dplan_for(KernelConfig(**DECODE_VARIANTS[name]))
                poison(d_caches, ref_dst)
                vplan.launch()
                vplan.check()
                sync()
                equal = all(torch.equal(d_caches[n], ref_dst[n]) for n in names)
                r["decode_variants"][name] = {"ms": bench_ms(vplan.launch), "equal": equal}
            except Exception as exc:  # noqa: BLE001 - a shape that does not build is reported
                r["decode_variants"][name] = {"error": repr(exc)[:300], "equal": False}
            log(f"  decode variant {name}: {r['decode_variants'][name]}")
        poison(d_caches, ref_dst)
        dplan.launch()
        sync()
    r["load_vs_one_launch"] = r["load_ms"] / r["decode_one_launch_ms"]
    r["load_all_at_once_vs_one_launch"] = r["load_all_at_once_ms"] / r["decode_one_launch_ms"]
    # decoded KV vs the prefill's source under the codec (the error of the preset)
    full = max(1, min(4, tokens // BLOCK))  # whole blocks only
    k_src = src[names[1]][0][torch.tensor(p_ids[:full])].float()
    k_dst = d_caches[names[1]][0][torch.tensor(d_ids[:full])].float()
    r["decoded_rel_err_layer1_k"] = float((k_src - k_dst).norm() / k_src.norm())
    ci = r["layer_pct_ci95"]
    log(f"  {tokens:6d} tok {preset:5s}: forward {fw:.2f} ms | layer {r['layer_pct']:+.2f}% "
        f"[{ci[0]:+.2f}, {ci[1]:+.2f}] batched {r['batched_pct']:+.2f}% hiprio "
        f"{r['layer-hiprio_pct']:+.2f}% layer+sync {r['layer+sync_pct']:+.2f}% inline "
        f"{r['layer-inline_pct']:+.2f}%"
        + "".join(f" {v} {r[v + '_pct']:+.2f}%" for v in variants[5:]) + " legacy "
        f"{r['legacy_pct']:+.2f}% | A/A {r['aa_pct']:+.2f}% | encode 1-launch "
        f"{r['encode_one_launch_ms']:.3f} ms ({r['encode_pct_of_forward']:.2f}%, {enc_name}) | "
        f"load landed->finished {r['load_ms']:.3f} ms (post {r['load_post_ms']:.3f}, to launch "
        f"{r['load_to_first_launch_ms']:.3f}, launch {r['load_launch_host_ms']:.3f} (replays "
        f"{r['load_replay_host_ms'] or 0:.3f}), after "
        f"{r['load_after_last_launch_ms']:.3f}, {r['load_launches']} launches; to first "
        f"replay {r['load_to_first_replay_ms'] or 0:.3f}, GPU {r['load_launch_gpu_ms'] or 0:.3f}"
        f", verdict wait {r['load_verdict_wait_ms'] or 0:.3f}, after verdict "
        f"{r['load_after_verdict_ms'] or 0:.3f}, GC worst/loads {r['load_gc_ms']}) vs 1-launch "
        f"{r['decode_one_launch_ms']:.3f} ms ({dec_name}) = {r['load_vs_one_launch']:.2f}x; "
        f"all at once {r['load_all_at_once_ms']:.3f} ms; launch deferred to the first ask "
        f"{r['load_deferred_launch_ms']:.3f} ms; without graph {r['load_no_graph_ms']:.3f}"
        f" ms (launch {r['load_no_graph_launch_host_ms']:.3f}); a decode call per READ "
        f"{r['load_per_group_ms']:.3f} ms; first two READs, a poll, the rest "
        f"{r['load_two_polls_ms']:.3f} ms ({r['load_two_polls_launches']} launches, "
        f"{r['load_two_polls_replays']} replays); two READs in flight to the end "
        f"{r['load_pairwise_reads_ms']:.3f} ms (to first replay "
        f"{r['load_pairwise_to_first_replay_ms'] or 0:.3f}), {r['load_graph_replays']} "
        f"replays | host "
        f"{r['host_us_per_save_kv_layer']:.0f} us/layer, step plan "
        f"{r['host_ms_step_plan_build']:.2f} ms, load plan {r['host_ms_load_plan_build']:.2f} ms"
        f", decode launch pair {r['host_us_decode_launch_pair']:.0f} us | clocks {r['clocks']}"
        f" | spot check {r['reference_spot_check']}")
    for w in (p, d):
        w.shutdown()
    fwd.w.clear()
    del src, d_caches, ref_dst
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return r


OUT_DIR: Path | None = None


def restore_wrapped(saved_instance: list[tuple[Any, str, Any]],
                    saved_class: list[tuple[type, str, Any]]) -> None:
    """Undo the wrappers of trace_load / timeline_load: ``(owner, name, what its own __dict__
    held)``, None where the attribute came from elsewhere (an instance's class, a base class)."""
    for o, n, old in saved_instance:
        if old is None:
            o.__dict__.pop(n, None)
        else:
            setattr(o, n, old)
    for c, n, old in saved_class:
        if old is None:
            delattr(c, n)
        else:
            setattr(c, n, old)


def trace_load(d, make_meta, tag: str, log, loads: int = 3) -> dict[str, Any]:
    """A torch.profiler timeline (host + GPU) of held loads, the loader's and the GPU path's
    steps marked with ``record_function``: where landed -> finished goes. The chrome trace is
    saved beside the results; the last load's steps are summarised relative to "landed"."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    from turbowire.connector import gpu_path

    def marked(name: str, fn):
        def wrapper(*a: Any, **k: Any) -> Any:
            with record_function(name):
                return fn(*a, **k)
        return wrapper

    lo = d.loader
    on_instance = [(d, "get_transfer_results"), (lo, "_advance"), (lo, "_take_landed"),
                   (lo, "_post_more"), (lo, "_decode_group"), (lo, "_complete"),
                   (lo, "_release_async"), (d.gpu, "decode_group"), (d.gpu, "_flush")]
    on_class = [(gpu_path._Launch, "check"), (gpu_path.PendingGroup, "result"),
                (gpu_path.PendingGroup, "done")]
    saved_instance = [(o, n, o.__dict__.get(n)) for o, n in on_instance]
    saved_class = [(c, n, c.__dict__[n]) for c, n in on_class]
    for o, n in on_instance:
        setattr(o, n, marked(f"tw.{n}", getattr(o, n)))
    for c, n in on_class:
        setattr(c, n, marked(f"tw.{c.__name__}.{n}", c.__dict__[n]))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    transport = d.transport
    try:
        with profile(activities=activities) as prof:
            for i in range(loads):
                lm = make_meta(i)
                sync()
                transport.hold = True
                with record_function("load.post"):
                    d.start_load_kv(lm)
                with record_function("load.landed"):
                    transport.hold = False
                    poll_until_finished(d, f"t{i}")
                sync()
                d.get_transfer_results()  # the next step: release and metrics of this load
                d.take_reports()
    finally:
        restore_wrapped(saved_instance, saved_class)
    path = None
    if OUT_DIR is not None:
        path = OUT_DIR / f"load_trace_{tag}.json"
        prof.export_chrome_trace(str(path))
    events = prof.events()
    landed = [e for e in events if e.name == "load.landed"]
    if not landed:
        return {"error": "no load.landed range in the trace"}
    last = landed[-1]
    t0, t1 = last.time_range.start, last.time_range.end
    rows = []
    for e in events:
        start, end = e.time_range.start, e.time_range.end
        if end < t0 or start > t1 + 2000:
            continue
        is_gpu = getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type)
        if e.name.startswith("tw.") or is_gpu or e.name in ("cudaEventSynchronize",
                                                             "cudaGraphLaunch",
                                                             "cudaStreamSynchronize"):
            rows.append({"name": ("gpu " if is_gpu else "") + e.name[:60],
                         "start_us": round(start - t0, 1), "us": round(end - start, 1)})
    rows.sort(key=lambda x: x["start_us"])
    out = {"landed_us": round(t1 - t0, 1), "steps": rows[:120], "trace": str(path)}
    log(f"  load trace {tag} (last of {loads} held loads, landed -> finished "
        f"{out['landed_us']:.0f} us under the profiler):\n" + "\n".join(
            f"    {x['start_us']:9.1f} +{x['us']:8.1f} us  {x['name']}" for x in rows[:80]))
    return out


def poll_until_finished(d, rid: str) -> None:
    """Poll the decode worker as vLLM does each step until ``rid`` is reported; a failed load
    raises with the worker's reports."""
    fin: set[str] = set()
    while rid not in fin:
        f, x = d.get_transfer_results()
        if x:
            raise RuntimeError(f"load {rid} failed: {d.take_reports().reports}")
        fin |= f


def timeline_load(d, make_meta, tag: str, log, loads: int = 12) -> dict[str, Any]:
    """Where the host time of landed -> finished goes, without a profiler: the loader's, the
    worker's, the GPU path's and the torch calls on the load's path wrapped with perf-counter
    marks (each mark costs ~0.3-0.5 us, so the instrumented loads run a little slower than the
    plain ones). Per call site: calls per load, the first call's start after the landing and
    the inclusive time summed over the load's calls, medians over ``loads`` held loads."""
    from turbowire.connector import gpu_path
    from turbowire.connector import loader as loader_mod
    from turbowire.kernels import triton_plans

    marks: list[tuple[str, float, float]] = []
    clock = time.perf_counter

    def marked(name: str, fn):
        def wrapper(*a: Any, **k: Any) -> Any:
            t = clock()
            try:
                return fn(*a, **k)
            finally:
                marks.append((name, t, clock()))
        return wrapper

    lo = d.loader
    on_instance = [(d, "get_transfer_results"), (d, "_decode_group"), (d.transport, "read")]
    on_class = [
        (loader_mod.KVLoader, n) for n in (
            "results", "_settle_completed", "_progress", "_reclaim", "_advance", "_claimed",
            "_take_landed", "_link_idle", "_post_more", "_post_read", "_decode_group",
            "_free_recv", "_complete")
    ] + [(gpu_path.GpuPaths, n) for n in ("decode_group", "_entry", "_graphs_for")] + [
        (gpu_path._Launch, "check"), (gpu_path._Launch, "done"),
        (gpu_path.PendingGroup, "result"), (gpu_path.PendingGroup, "done"),
        (triton_plans.DecodeLayersPlan, "check"), (FakeTransfer, "state"),
        (FakeTransfer, "release"), (type(lo._recv_ranges), "free"),
    ]
    if DEVICE == "cuda":
        on_class += [(torch.cuda.CUDAGraph, "replay"), (torch.cuda.Event, "record"),
                     (torch.cuda.Event, "synchronize"), (torch.cuda.Event, "query"),
                     (torch.Tensor, "copy_"), (torch.Tensor, "tolist")]
    saved_instance = [(o, n, o.__dict__.get(n)) for o, n in on_instance]
    saved_class = [(c, n, c.__dict__.get(n)) for c, n in on_class]
    real_current = torch.cuda.current_stream
    for o, n in on_instance:
        setattr(o, n, marked(n, getattr(o, n)))
    for c, n in on_class:
        raw = c.__dict__.get(n, getattr(c, n))
        if isinstance(raw, staticmethod):
            setattr(c, n, staticmethod(marked(f"{c.__name__}.{n}", raw.__func__)))
        else:
            setattr(c, n, marked(f"{c.__name__}.{n}", getattr(c, n)))
    torch.cuda.current_stream = marked("torch.cuda.current_stream", real_current)
    transport = d.transport
    per_load: list[dict[str, tuple[int, float, float]]] = []
    totals: list[float] = []
    try:
        for i in range(loads):
            lm = make_meta(i)
            sync()
            transport.hold = True
            d.start_load_kv(lm)
            marks.clear()
            transport.hold = False
            t0 = clock()
            poll_until_finished(d, f"t{i}")
            t1 = clock()
            totals.append((t1 - t0) * 1e6)
            rows: dict[str, tuple[int, float, float]] = {}
            for name, a, b in marks:
                if a > t1:
                    continue
                n, first, incl = rows.get(name, (0, (a - t0) * 1e6, 0.0))
                rows[name] = (n + 1, first, incl + (b - a) * 1e6)
            per_load.append(rows)
            sync()
            d.get_transfer_results()  # the next step: release and metrics of this load
            d.take_reports()
    finally:
        torch.cuda.current_stream = real_current
        restore_wrapped(saved_instance, saved_class)
    names = sorted({n for rows in per_load for n in rows},
                   key=lambda n: statistics.median(r[n][1] for r in per_load if n in r))
    steps = []
    for n in names:
        got = [r[n] for r in per_load if n in r]
        steps.append({"name": n, "calls": statistics.median(g[0] for g in got),
                      "first_us": round(statistics.median(g[1] for g in got), 1),
                      "incl_us": round(statistics.median(g[2] for g in got), 1)})
    out = {"landed_us": round(statistics.median(totals), 1), "loads": loads, "steps": steps}
    log(f"  load timeline {tag} (median of {loads} held loads, instrumented: landed -> "
        f"finished {out['landed_us']:.0f} us):\n" + "\n".join(
            f"    first at {x['first_us']:8.1f} us  {x['calls']:5.1f} calls  "
            f"{x['incl_us']:8.1f} us incl  {x['name']}" for x in steps))
    return out


def trace_steps(step, variants: list[str], tag: str, log) -> dict[str, Any]:
    """One step of each variant under torch.profiler: per stream, kernel time; matmul kernel
    time (the forward's work: does the encode slow it?); encode kernel time and the part of it
    that ran while a forward kernel ran; the step's span. The first variant's chrome trace is
    kept (gzip) under --out."""
    import gzip
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    out: dict[str, Any] = {}
    for v in variants:
        fn = step(v)
        sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            sync()
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            path = f.name
        prof.export_chrome_trace(path)
        data = json.load(open(path))
        os.unlink(path)
        ks = [e for e in data.get("traceEvents", []) if e.get("cat") == "kernel"]
        if not ks:
            out[v] = {"kernels": 0}
            continue
        streams: dict[Any, float] = {}
        for e in ks:
            streams[e["args"].get("stream")] = streams.get(e["args"].get("stream"), 0) + e["dur"]
        main = max(streams, key=lambda k: streams[k])
        fwd_iv = sorted((e["ts"], e["ts"] + e["dur"]) for e in ks
                        if e["args"].get("stream") == main)
        enc = [e for e in ks if "encode_kernel" in e["name"]]

        def overlap(a: float, b: float) -> float:
            tot = 0.0
            for s0, s1 in fwd_iv:
                if s1 <= a:
                    continue
                if s0 >= b:
                    break
                tot += min(b, s1) - max(a, s0)
            return tot

        out[v] = {
            "span_ms": (max(e["ts"] + e["dur"] for e in ks) - min(e["ts"] for e in ks)) / 1e3,
            "stream_kernel_ms": {str(k): round(t / 1e3, 3) for k, t in streams.items()},
            "matmul_ms": sum(e["dur"] for e in ks if e["args"].get("stream") == main
                             and "encode" not in e["name"] and "index" not in e["name"]
                             and ("gemm" in e["name"].lower() or "nvjet" in e["name"]
                                  or "sm90" in e["name"] or "cutlass" in e["name"])) / 1e3,
            "encode_ms": sum(e["dur"] for e in enc) / 1e3,
            "encode_overlapping_forward_ms": sum(overlap(e["ts"], e["ts"] + e["dur"])
                                                 for e in enc) / 1e3,
            "encode_launches": len(enc),
            "kernel_names": sorted({e["name"][:60] for e in ks})[:12],
        }
        if OUT_DIR is not None and v == "layer":
            with gzip.open(OUT_DIR / f"trace_{tag}_{v}.json.gz", "wt") as g:
                json.dump({"traceEvents": ks}, g)
    log(f"  trace {tag}: {json.dumps(out)}")
    return out


def paired_rounds(step, variants: list[str], rounds: int) -> dict[str, Any]:
    """Each round runs forward, v1, forward, v2, ..., forward (the variants' order rotated from
    round to round): a variant's sample is its time minus the mean of the two forwards beside
    it, so drift (clocks, temperature) cancels; "aa" holds the same difference for the inner
    forwards (the A/A test: what noise alone gives)."""
    diff: dict[str, list[float]] = {v: [] for v in variants}
    aa: list[float] = []
    fwd: list[float] = []
    for k in range(rounds):
        order = variants[k % len(variants):] + variants[:k % len(variants)]
        seq = ["forward"]
        for v in order:
            seq += [v, "forward"]
        fns = [step(v) for v in seq]  # metadata made outside the timing
        t = [time_step(fn, 1)[0] for fn in fns]
        f = t[0::2]
        fwd += f
        for j, v in enumerate(order):
            diff[v].append(t[2 * j + 1] - (f[j] + f[j + 1]) / 2)
        for j in range(1, len(f) - 1):
            aa.append(f[j] - (f[j - 1] + f[j + 1]) / 2)
    return {"diff": diff, "aa": aa or [0.0], "forward": fwd}


def bootstrap_median(x: list[float], n: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of the median."""
    a = np.asarray(x, dtype=np.float64)
    if a.size < 2:
        return float(a.mean()), float(a.mean())
    rng = np.random.default_rng(0)
    meds = np.median(a[rng.integers(0, a.size, (n, a.size))], axis=1)
    return float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


class ClockSampler:
    """SM clock and board power through NVML (nvidia-ml-py) every 50 ms, in a thread."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception:  # noqa: BLE001 - no NVML: no clocks in the report
            self._nvml = None

    def start(self) -> None:
        import threading

        if self._nvml is None or DEVICE != "cuda":
            return
        self._stop = threading.Event()

        def run() -> None:
            nv = self._nvml
            while not self._stop.wait(0.05):
                try:
                    self.samples.append((nv.nvmlDeviceGetClockInfo(self._h, nv.NVML_CLOCK_SM),
                                         nv.nvmlDeviceGetPowerUsage(self._h) / 1e3))
                except Exception:  # noqa: BLE001
                    return

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()
            self._thread.join()

    def summary(self) -> dict[str, Any] | None:
        if not self.samples:
            return None
        mhz = np.array([x[0] for x in self.samples])
        watts = np.array([x[1] for x in self.samples])
        return {"sm_mhz_p10_p50_p90": [int(np.percentile(mhz, q)) for q in (10, 50, 90)],
                "watts_p50_max": [round(float(np.median(watts))), round(float(watts.max()))]}


def graph_probe(plan_step, log) -> dict[str, Any]:
    """Can one layer's encode launch live in a CUDA graph, and what would it save? Captures
    ``launch_layer(0)`` of this step's plan and times replays against eager launches (host
    time per launch, GPU time per launch). A graph bakes the plan's table pointers and grid in:
    a later step (other blocks, slots, chunk count) would replay this step's encode."""
    if DEVICE != "cuda":
        return {}
    plan = plan_step.plans[0][0]
    out: dict[str, Any] = {}
    try:
        plan.launch_layer(0)
        sync()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            plan.launch_layer(0)
        sync()
        n = 100
        for name, fn in (("eager", lambda: plan.launch_layer(0)), ("graph", g.replay)):
            fn()
            sync()
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record()
            for _ in range(n):
                fn()
            b.record()
            host = (time.perf_counter() - t0) / n * 1e6
            sync()
            out[f"{name}_host_us"] = host
            out[f"{name}_gpu_us"] = a.elapsed_time(b) / n * 1e3
        out["captured"] = True
    except Exception as exc:  # noqa: BLE001 - the answer is then "it cannot be captured"
        out["captured"] = False
        out["error"] = repr(exc)
        log(f"  graph probe: {exc!r}")
    return out


def spot_check(p, d, save, offsets, names, src, d_caches, p_ids, d_ids, ref_staging,
               ref_dst) -> dict[str, Any]:
    """At full scale, a few chunks (first blocks, last block; first and last layer) against the
    reference codec on this GPU: staged bytes equal to the reference encode, decoded values
    (the decode worker's cache after its loads) equal to the reference decode of those bytes."""
    layers = len(names)
    pick = sorted({0, 1, 2, len(save.blocks) - 1})
    blocks = [save.blocks[i] for i in pick]
    enc_ok = dec_ok = True
    for layer in (0, layers - 1):
        items = [EncodeItem(save.block_ids, b.index * BLOCK, b.num_tokens,
                            p.layout.chunk_offset(b.slot, layer), b.tag) for b in blocks]
        ref = torch.zeros(p.staging.numel(), dtype=torch.uint8, device=p.staging.device)
        written = encode_into(p.codec, layer, src[names[layer]], p.caches.layouts[layer], items,
                              ref, impl="reference")
        for it, n in zip(items, written):
            a = ref_staging[it.out_offset:it.out_offset + n]
            enc_ok &= bool(torch.equal(a, ref[it.out_offset:it.out_offset + n]))
        del ref
        dst = torch.full_like(d_caches[names[layer]], 7.0)
        ditems = [DecodeItem(d_ids, b.index * BLOCK, b.num_tokens, offsets[(bi, layer)][0],
                             offsets[(bi, layer)][1], b.tag) for bi, b in zip(pick, blocks)]
        decode_into(d.codec, layer, dst, d.caches.layouts[layer], ditems, d.recv,
                    impl="reference")
        for b in blocks:  # the rows the chunk covers (vLLM's GPU layout [2, blocks, bs, ...])
            bid, nt = d_ids[b.index], b.num_tokens
            dec_ok &= bool(torch.equal(dst[:, bid, :nt], ref_dst[names[layer]][:, bid, :nt]))
        del dst
    return {"chunks": len(blocks) * 2, "encode_equal_reference": enc_ok,
            "decode_equal_reference": dec_ok}


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| tokens | preset | forward ms | + save, per-layer launches (default) [95% CI] "
            "| + save, one batched launch | per-layer, high-priority side stream "
            "| per-layer + host sync | per-layer on the forward's stream "
            "| pre-plan path (encode_into per layer) | A/A noise "
            "| encode kernels alone ms (% of forward) | load ms/request: landed -> finished "
            "| one-launch decode ms | load / one-launch | load, a decode call per READ ms "
            "| load, READs done at once (incl. plan build) ms "
            "| start_load_kv ms (READs posted, plan built) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ci = r["layer_pct_ci95"]
        lines.append(
            f"| {r['tokens']} | {r['preset']} | {r['forward_ms']:.2f} "
            f"| {r['layer_pct']:+.2f}% [{ci[0]:+.2f}, {ci[1]:+.2f}] "
            f"| {r['batched_pct']:+.2f}% | {r['layer-hiprio_pct']:+.2f}% "
            f"| {r['layer+sync_pct']:+.2f}% | {r['layer-inline_pct']:+.2f}% "
            f"| {r['legacy_pct']:+.2f}% | {r['aa_pct']:+.2f}% "
            f"| {r['encode_one_launch_ms']:.3f} ({r['encode_pct_of_forward']:.2f}%) "
            f"| {r['load_ms']:.3f} | {r['decode_one_launch_ms']:.3f} "
            f"| {r['load_vs_one_launch']:.2f}x | {r['load_per_group_ms']:.3f} "
            f"| {r['load_all_at_once_ms']:.3f} "
            f"({r['load_all_at_once_vs_one_launch']:.2f}x) | {r['load_post_ms']:.3f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path,
                    default=Path(os.environ.get("OUT", "bench/results/gpu_connector_path")))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--iters", type=int, default=0, help="timed steps per variant (0: auto)")
    ap.add_argument("--skip-kernel-check", action="store_true")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--sweep", action="store_true",
                    help="time the launch shapes of CONFIGS at 4k and use the fastest")
    ap.add_argument("--trace", action="store_true",
                    help="profile one step per save variant (torch.profiler) and summarise")
    ap.add_argument("--decode-variants", default="",
                    help="comma-separated names of DECODE_VARIANTS to time (<= 8k tokens)")
    ap.add_argument("--profile-load", action="store_true",
                    help="cProfile one load's landed -> finished")
    ap.add_argument("--trace-load", action="store_true",
                    help="torch.profiler timeline of held loads (saved as load_trace_*.json)")
    ap.add_argument("--load-timeline", action="store_true",
                    help="perf-counter marks on every call of held loads' landed -> finished")
    ap.add_argument("--encode-cap", type=int, default=0,
                    help="also time per-layer saves with the encoder capped at N registers")
    ap.add_argument("--deadline", type=float, default=0.0,
                    help="seconds after which no further case starts (0: none)")
    args = ap.parse_args()
    global SWEEP, TRACE, PROFILE_LOAD, TRACE_LOAD, TIMELINE_LOAD, ENCODE_CAP, OUT_DIR, VARIANTS
    SWEEP = args.sweep
    TRACE = args.trace
    PROFILE_LOAD = args.profile_load
    TRACE_LOAD = args.trace_load
    TIMELINE_LOAD = args.load_timeline
    ENCODE_CAP = args.encode_cap
    VARIANTS = [v for v in args.decode_variants.split(",") if v]
    for v in VARIANTS:
        if v not in DECODE_VARIANTS:
            ap.error(f"unknown decode variant {v!r} (one of {', '.join(DECODE_VARIANTS)})")
    OUT_DIR = args.out
    args.out.mkdir(parents=True, exist_ok=True)
    logf = open(args.out / "log.txt", "a")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    import triton

    env = {"gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu (interpreter)",
           "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
           "python": sys.version.split()[0], "turbowire": HOW, "command": " ".join(sys.argv)}
    log(json.dumps(env))
    report: dict[str, Any] = {"env": env, "checks": [], "kernel_checks": [], "results": []}

    def save() -> None:
        (args.out / "results.json").write_text(json.dumps(report, indent=1, default=str))

    presets = [x for x in args.presets.split(",") if x]
    t0 = time.time()
    if not args.skip_kernel_check:  # bench/kernels.py's checks (kernels vs the reference)
        spec = importlib.util.spec_from_file_location("tw_bench_kernels", REPO / "bench" /
                                                      "kernels.py")
        assert spec is not None and spec.loader is not None
        kb = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = kb
        spec.loader.exec_module(kb)
        for preset in presets:
            for layout in ("LBNHC", "LBHNC"):
                c = kb.run_check(kb.CheckCase(preset, 128, 8, layout))
                c.pop("traceback", None)
                report["kernel_checks"].append(c)
                log(f"[kernel check] {c['case']}: ok={c.get('ok')} enc={c.get('encode_bitexact')}"
                    f" dec={c.get('decode_bitexact')} {c.get('error', '')}")
        save()
    if not args.skip_check:
        for preset in presets:
            try:
                report["checks"].append(connector_check(preset, log))
                report["checks"].append(store_check(preset, log))
            except Exception as exc:  # noqa: BLE001
                log(f"[connector check] {preset} failed: {exc}\n{traceback.format_exc()}")
                report["checks"].append({"preset": preset, "ok": False, "error": repr(exc)})
            save()
    log(f"checks done in {time.time() - t0:.0f}s")
    for tokens in [int(x) for x in args.tokens.split(",") if x]:
        for preset in presets:
            iters = args.iters or (2 if SMOKE else 30 if tokens <= 8192 else 6)
            if args.deadline and time.time() - t0 > args.deadline:
                log(f"{tokens} {preset}: skipped, past the --deadline")
                continue
            try:
                report["results"].append(run_case(tokens, preset, log, iters))
            except Exception as exc:  # noqa: BLE001
                log(f"{tokens} {preset} failed: {exc}\n{traceback.format_exc()}")
            save()
    def case_ok(r: dict[str, Any]) -> bool:
        spot = r.get("reference_spot_check", {})
        return bool(all(r.get("staging_equal_layer_batched_hiprio_legacy", [False]))
                    and r.get("decode_equal_reference_shape")
                    and r.get("decode_equal_graph_loads") and r.get("decode_equal_direct_loads")
                    and r.get("decode_equal_eager_loads")
                    and r.get("decode_equal_per_group_loads")
                    and r.get("decode_equal_pairwise_loads")
                    and r.get("decode_equal_two_poll_loads")
                    and r.get("decode_equal_traced_loads", True)
                    and r.get("decode_equal_timeline_loads", True)
                    and spot.get("encode_equal_reference") and spot.get("decode_equal_reference"))

    cases = report["results"]
    ok = (all(c.get("ok") for c in report["checks"] + report["kernel_checks"])
          and all(case_ok(r) for r in cases) and bool(cases))
    md = ["## GPU connector path (issue 18)", "", f"`{env['command']}` on {env['gpu']}, torch "
          f"{env['torch']}, triton {env['triton']}, CUDA {env['cuda']}", "",
          f"bit-exact on this GPU: {'yes' if ok else 'NO'} (kernel checks "
          f"{sum(bool(c.get('ok')) for c in report['kernel_checks'])}/"
          f"{len(report['kernel_checks'])}, connector checks "
          f"{sum(bool(c.get('ok')) for c in report['checks'])}/{len(report['checks'])}, "
          f"full-scale cases {sum(case_ok(r) for r in cases)}/{len(cases)}: staging bytes equal "
          "across per-layer, batched, high-priority and pre-plan paths, loads equal to the "
          "one-launch decode, spot chunks equal to the reference codec)", "",
          table(cases)]
    (args.out / "results.md").write_text("\n".join(md) + "\n")
    save()
    log("\n".join(md))
    log(f"total {time.time() - t0:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
