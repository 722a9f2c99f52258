"""The worker's GPU path (connector/gpu_path.py) driven through the worker's own calls, on CPU
under Triton's interpreter (``force``: the same plans, launched inline without streams).

Prefill: per-layer ``save_kv_layer`` calls (some layers left to ``wait_for_save``) and the
batched mode must stage exactly the bytes of the per-layer path CPU engines use, and count the
same dense/wire bytes. Decode: ``_decode_group`` per landed group must write exactly what the
per-layer path writes, verify a group before writing any of it, and raise the reference's
exception for a corrupt chunk.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by tests/conftest.py

from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)

from turbowire.codec import ChecksumError  # noqa: E402
from turbowire.connector import gpu_path  # noqa: E402
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
from turbowire.connector.stats import iter_counters  # noqa: E402
from turbowire.kernels.triton_dispatch import KernelConfig  # noqa: E402

BS, HEADS, DIM, NB = 16, 1, 64, 16
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
SMALL = KernelConfig(num_warps=1, tile_rows=16)
GUARD = 7.0


class FakeTransport:
    name = "fake"
    agent_name = "fake-agent"

    def register(self, tensor) -> None:
        pass

    def local_metadata(self) -> bytes:
        return b"md"

    def close(self) -> None:
        pass


def make_worker(monkeypatch, preset: str, gpu: bool, mode: str = "layer"):
    monkeypatch.setattr(worker_mod, "make_transport", lambda config, name: FakeTransport())
    extra = {"preset": preset, "staging_bytes": "1MiB", "decode_pipeline_groups": 2}
    ktc = KVTransferConfig(kv_connector="TurboWireConnector", kv_role="kv_both",
                           kv_connector_extra_config=extra, engine_id=f"e-{preset}-{gpu}")
    vcfg = SimpleNamespace(
        kv_transfer_config=ktc,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_index=0),
        model_config=SimpleNamespace(model="/m/tiny", served_model_name="tiny"),
        speculative_config=None, compilation_config=SimpleNamespace(static_forward_context={}))
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=DIM,
                             dtype=torch.bfloat16)
    kcfg = KVCacheConfig(num_blocks=NB, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])
    cfg = TurboWireConfig.from_extra_config(extra, environ={})
    w = worker_mod.TurboWireWorker(vcfg, kcfg, cfg, f"e-{preset}-{gpu}")
    return w


def gpu_caches(seed: int | None):
    """vLLM's GPU layout [2, blocks, block_size, heads, head_dim] per layer (on the CPU)."""
    g = torch.Generator().manual_seed(seed or 0)
    out = {}
    for n in LAYERS:
        if seed is None:
            x = torch.full((2, NB, BS, HEADS, DIM), GUARD)
        else:
            x = torch.randn((2, NB, BS, HEADS, DIM), generator=g) * 2 + torch.linspace(-2, 2, DIM)
        out[n] = x.to(torch.bfloat16)
    return out


def register(w, caches, gpu: bool, mode: str = "layer"):
    w.register_kv_caches(caches)
    assert w.gpu is None  # CPU caches: the per-layer path, unless forced below
    if gpu:
        # one deferred layer: layer 0 is noted, layer 1 builds the plan and launches both
        w.gpu = gpu_path.GpuPaths(w.codec, w.geometry, w.layout, w.caches, w.staging, w.recv,
                                  w.chunk_nbytes, mode=mode, kernel_config=SMALL,
                                  defer_layers=1)


def save_meta() -> TurboWireConnectorMetadata:
    saves = []
    for rid, blocks, ntok, first in (("a", [3, 7, 1], 37, 0), ("b", [9, 2, 12, 5], 62, 2)):
        bl = []
        for i in range(first, len(blocks)):
            tokens = min(BS, ntok - i * BS)
            bl.append(SaveBlock(i, blocks[i], tokens, len(saves) * 4 + i, block_tag(rid, i)))
        saves.append(SaveRequest(rid, blocks, bl))
    return TurboWireConnectorMetadata(saves=saves)


def sent(w) -> dict:
    return {(n, lbl.get("direction")): v for n, lbl, v in iter_counters(w.stats.data)
            if n in ("dense_bytes", "wire_bytes")}


@pytest.mark.parametrize("preset,mode", [("tq4", "layer"), ("k4v3", "batched")])
def test_gpu_path_stages_and_loads_what_the_layer_path_does(monkeypatch, preset, mode):
    src = gpu_caches(seed=1)
    ref = make_worker(monkeypatch, preset, False)
    register(ref, src, False)
    w = make_worker(monkeypatch, preset, True)
    register(w, src, True, mode)
    meta = save_meta()
    for worker in (ref, w):
        for name in LAYERS[:2]:  # the last layer is left to wait_for_save
            worker.save_kv_layer(name, src[name], meta)
        if worker is w and mode == "layer":  # launched per layer, before wait_for_save
            assert w.gpu._step is not None and w.gpu._step.launched == {0, 1}
        worker.wait_for_save(meta)
    assert torch.equal(w.staging, ref.staging)
    if mode == "layer":
        assert w.gpu._step is None and w.gpu._noted is None
    assert sent(w) == sent(ref) and sent(w)
    assert w.gpu._step is None  # the step's plan is dropped once saved

    # ---- decode request "b" into other blocks, in two groups, as the loader hands them over
    save = meta.saves[1]
    dst_ids = [4, 11, 6, 0]
    load = LoadRequest("d", "b", PeerAddress("p", "h", 1, 1),
                       [LoadBlock(b.index, dst_ids[b.index], b.num_tokens, b.slot, b.tag)
                        for b in save.blocks], preset, dst_ids)
    n_l = len(LAYERS)
    sizes = np.array([[w.chunk_nbytes(layer, b.num_tokens, b.index) for b in load.blocks]
                      for layer in range(n_l)], dtype=np.int64)
    flat = sizes.reshape(-1)
    offsets = ChunkOffsets((np.cumsum(flat) - flat).reshape(sizes.shape), sizes)
    recv_offset = 4096
    for worker in (ref, w):
        for layer in range(n_l):
            for bi, b in enumerate(load.blocks):
                at = worker.layout.chunk_offset(b.slot, layer)
                off, size = offsets[(bi, layer)]
                worker.recv[recv_offset + off:recv_offset + off + size] = \
                    w.staging[at:at + size]
    dsts = []
    for worker in (ref, w):
        dst = gpu_caches(None)
        worker.caches.tensors[:] = [dst[n] for n in LAYERS]
        for layers in (range(0, 2), range(2, 3)):
            worker._decode_group(load, layers, recv_offset, offsets)
        dsts.append(dst)
    for name in LAYERS:
        assert torch.equal(dsts[0][name], dsts[1][name]), name
    assert not torch.equal(dsts[1][LAYERS[0]], gpu_caches(None)[LAYERS[0]])
    assert not w.gpu._loads  # the load's plan is dropped after its last group

    # ---- a corrupt chunk in the second group: it fails, nothing of the group is written
    at = recv_offset + offsets[(1, 2)][0] + 80
    w.recv[at] ^= 0x11
    dst = gpu_caches(None)
    w.caches.tensors[:] = [dst[n] for n in LAYERS]
    w._decode_group(load, range(0, 2), recv_offset, offsets)
    with pytest.raises(ChecksumError):
        w._decode_group(load, range(2, 3), recv_offset, offsets)
    assert torch.equal(dst[LAYERS[2]], gpu_caches(None)[LAYERS[2]])
    assert torch.equal(dst[LAYERS[0]], dsts[0][LAYERS[0]])
    assert not w.gpu._loads


def test_applies_only_to_cuda_caches(monkeypatch):
    w = make_worker(monkeypatch, "tq4", False)
    register(w, gpu_caches(seed=2), False)
    assert not gpu_path.applies(w.codec, w.caches)
    with pytest.raises(ValueError, match="mode"):
        gpu_path.GpuPaths(w.codec, w.geometry, w.layout, w.caches, w.staging, w.recv,
                          w.chunk_nbytes, mode="graph")
