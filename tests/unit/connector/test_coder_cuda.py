"""The worker's CUDA coder (connector/coder/cuda.py) driven through the worker's own calls, on CPU
under Triton's interpreter (forced: the same plans, launched inline without streams).

Prefill: per-layer ``save_kv_layer`` calls (some layers left to ``wait_for_save``) and the
batched mode must stage exactly the bytes of the per-layer path CPU engines use, and count the
same dense/wire bytes. Decode: the coder's ``decode`` per landed group hands back a handle; settled,
it must have written exactly what the per-layer path writes, never written a chunk that fails
verification (the valid chunks launched with it are written: they are the same load's blocks),
and raise the reference's exception for a corrupt chunk; an abandoned handle launches nothing.
The loader finishes a load only once every such handle ran, fails it on a refusal (the whole
load: vLLM recomputes its blocks) and abandons the rest.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by tests/conftest.py

from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from support.fakes import (  # noqa: E402
    FakeClient,
    FakeTransport,
    InlineExecutor,
    attach_loader,
    load_request,
    save_request,
    use_cuda_coder,
)
from support.fakes import make_worker as build_worker  # noqa: E402

from turbowire.codec import ChecksumError  # noqa: E402
from turbowire.connector.coder import ChunkOffsets, CudaCoder, HostCoder  # noqa: E402
from turbowire.connector.coder import cuda as cuda_coder  # noqa: E402
from turbowire.connector.coder.cuda_graphs import DecodeGraphs  # noqa: E402
from turbowire.connector.coder.cuda_load import PendingGroup  # noqa: E402
from turbowire.connector.config import TurboWireConfig  # noqa: E402
from turbowire.connector.metadata import (  # noqa: E402
    LoadBlock,
    LoadRequest,
    PeerAddress,
    TurboWireConnectorMetadata,
)
from turbowire.connector.stats import iter_counters  # noqa: E402
from turbowire.kernels import (  # noqa: E402
    BLOCK_ENCODE_REGISTERS,
    KernelConfig,
    block_kernel_config,
    cuda_serves,
)

BS, HEADS, DIM, NB = 16, 1, 64, 16
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
SMALL = KernelConfig(num_warps=1, tile_rows=16)
GUARD = 7.0


def make_worker(monkeypatch, preset: str, gpu: bool, mode: str = "layer", **more):
    extra = {"preset": preset, "staging_bytes": "1MiB", "decode_pipeline_groups": 2, **more}
    return build_worker(monkeypatch, extra, LAYERS, block_size=BS, num_kv_heads=HEADS,
                        head_size=DIM, num_blocks=NB, engine_id=f"e-{preset}-{gpu}")


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


def register(w, caches, gpu: bool, mode: str = "layer", monkeypatch=None):
    w.register_kv_caches(caches)
    assert isinstance(w.coder, HostCoder)  # CPU caches: the per-layer path, unless forced below
    if gpu:
        # one deferred layer: layer 0 is noted, layer 1 builds the plan and launches both
        if monkeypatch is not None:
            monkeypatch.setattr(cuda_coder, "DEFER_LAYERS", 1)
        use_cuda_coder(w, SMALL)
        w.coder.mode = mode


def save_meta() -> TurboWireConnectorMetadata:
    """Request "a" (37 tokens), and "b" (62 tokens) whose first 2 blocks are prefix-cache hits."""
    return TurboWireConnectorMetadata(saves=[
        save_request("a", [3, 7, 1], 37, BS, slot0=0),
        save_request("b", [9, 2, 12, 5], 62, BS, slot0=4, first=2)])


def sent(w) -> dict:
    return {(n, lbl.get("direction")): v for n, lbl, v in iter_counters(w.stats.data)
            if n in ("dense_bytes", "wire_bytes")}


@pytest.mark.parametrize("preset,mode", [("tq4", "layer"), ("k4v3", "batched")])
def test_gpu_path_stages_and_loads_what_the_layer_path_does(monkeypatch, preset, mode):
    src = gpu_caches(seed=1)
    ref = make_worker(monkeypatch, preset, False)
    register(ref, src, False)
    w = make_worker(monkeypatch, preset, True)
    register(w, src, True, mode, monkeypatch)
    meta = save_meta()
    for worker in (ref, w):
        for name in LAYERS[:2]:  # the last layer is left to wait_for_save
            worker.save_kv_layer(name, src[name], meta)
        if worker is w and mode == "layer":  # launched per layer, before wait_for_save
            assert w.coder._step is not None and w.coder._step.launched == {0, 1}
        worker.wait_for_save(meta)
    assert torch.equal(w.staging, ref.staging)
    if mode == "layer":
        assert w.coder._step is None and w.coder._noted is None
    assert sent(w) == sent(ref) and sent(w)
    assert w.coder._step is None  # the step's plan is dropped once saved

    # ---- decode request "b" into other blocks, in two groups, as the loader hands them over
    save = meta.saves[1]
    dst_ids = [4, 11, 6, 0]
    load = load_request("d", save, dst_ids, preset, PeerAddress("p", "h", 1, 1))
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
        if worker is w:  # the loader's hook when the READs are posted: the plan is built there
            worker.coder.prepare_load(load, recv_offset, offsets)
            assert len(w.coder.decoder.loads) == 1
        for layers in (range(0, 2), range(2, 3)):
            pending = worker.coder.decode(load, layers, recv_offset, offsets)
            # the CUDA coder hands back a handle of its launch; the host coder's ran already
            assert isinstance(pending, PendingGroup) == (worker is w)
            assert pending.done()  # launched when asked (inline on the CPU)
            pending.result()
        dsts.append(dst)
    for name in LAYERS:
        assert torch.equal(dsts[0][name], dsts[1][name]), name
    assert not torch.equal(dsts[1][LAYERS[0]], gpu_caches(None)[LAYERS[0]])
    assert not w.coder.decoder.loads  # the load's plan is dropped after its last group

    # ---- a corrupt chunk in the second group (block 1 of layer 2): it fails; the chunk is not
    # written (its rows keep the guard), the group's other chunks are, as the reference decodes
    at = recv_offset + offsets[(1, 2)][0] + 80
    w.recv[at] ^= 0x11
    bad_rows = (slice(None), dst_ids[load.blocks[1].index], slice(0, load.blocks[1].num_tokens))
    want = dsts[0][LAYERS[2]].clone()
    want[bad_rows] = GUARD
    dst = gpu_caches(None)
    w.caches.tensors[:] = [dst[n] for n in LAYERS]
    w.coder.decode(load, range(0, 2), recv_offset, offsets).result()
    with pytest.raises(ChecksumError):
        w.coder.decode(load, range(2, 3), recv_offset, offsets).result()
    assert torch.equal(dst[LAYERS[2]], want)
    assert bool((dst[LAYERS[2]][bad_rows] == GUARD).all())
    assert torch.equal(dst[LAYERS[0]], dsts[0][LAYERS[0]])
    assert not w.coder.decoder.loads

    # ---- groups that landed together are launched together: one refused chunk, both handles
    # raise; only the refused chunk is not written
    dst = gpu_caches(None)
    w.caches.tensors[:] = [dst[n] for n in LAYERS]
    first = w.coder.decode(load, range(0, 2), recv_offset, offsets)
    second = w.coder.decode(load, range(2, 3), recv_offset, offsets)
    assert first.launch is None and second.launch is None  # queued, nothing launched yet
    assert first.done() and first.launch is second.launch  # one launch for both
    for pending in (first, second):
        with pytest.raises(ChecksumError):
            pending.result()
    assert torch.equal(dst[LAYERS[2]], want)
    for name in LAYERS[:2]:
        assert torch.equal(dst[name], dsts[0][name]), name
    # ... and an abandoned load launches nothing of what was queued
    w.recv[at] ^= 0x11  # repaired
    dst = gpu_caches(None)
    w.caches.tensors[:] = [dst[n] for n in LAYERS]
    pending = w.coder.decode(load, range(0, 2), recv_offset, offsets)
    pending.abandon()
    assert not w.coder.decoder.loads
    for name in LAYERS:
        assert torch.equal(dst[name], gpu_caches(None)[name]), name


def test_applies_only_to_cuda_caches(monkeypatch):
    w = make_worker(monkeypatch, "tq4", False)
    register(w, gpu_caches(seed=2), False)
    assert not cuda_serves(w.codec, w.caches.tensors)
    with pytest.raises(ValueError, match="mode"):
        CudaCoder(w.codec, w.geometry, w.caches, w.layout, w.staging, w.recv, w.chunk_nbytes,
                  mode="graph")


def test_the_groups_landed_in_one_pass_get_one_captured_launch():
    """``_flush``'s choice among a load's captured launches (CUDA graphs, so only the choice is
    tested here): the launch of exactly the queued layers (one group, or all of them), else the
    groups' launches back to back, else none (direct launches); every captured launch covering
    any of those layers is dropped, so no layer is ever decoded by two of them; the dropped ones
    are retired (destroyed at the next load's ``prepare_load``, off the load's path)."""
    paths = DecodeGraphs(torch.device("cpu"))

    def pick(e, layers):
        return paths.take(e.graphs, layers)

    def entry():
        keys = [(0, 1), (1, 2), (2, 3), (3, 4), (0, 4)]
        return SimpleNamespace(graphs={k: k for k in keys})

    e = entry()
    assert pick(e, range(0, 4)) == [(0, 4)] and e.graphs == {}  # all landed together
    assert sorted(paths.retired) == sorted(entry().graphs)  # every one of them, once
    paths.retired.clear()
    e = entry()
    assert pick(e, range(0, 1)) == [(0, 1)]  # a group that landed alone
    assert e.graphs == {(1, 2): (1, 2), (2, 3): (2, 3), (3, 4): (3, 4)}
    assert sorted(paths.retired) == [(0, 1), (0, 4)]
    assert pick(e, range(1, 4)) == [(1, 2), (2, 3), (3, 4)] and e.graphs == {}
    e = entry()
    del e.graphs[(2, 3)]  # not captured (its kernels were not compiled yet): launched directly
    assert pick(e, range(1, 4)) == [] and e.graphs == {(0, 1): (0, 1)}
    assert pick(SimpleNamespace(graphs={}), range(0, 4)) == []


def test_a_corrupt_chunk_fails_the_load_and_is_the_only_chunk_not_written(monkeypatch):
    """Through the worker's loader and the GPU path: one corrupt chunk (block 0 of layer 1) in a
    group of several chunks (layers 0-1 x 2 blocks). The load fails as a whole (reason
    ``checksum``: vLLM recomputes its blocks); the corrupt chunk's rows keep their poison; the
    other chunks of its group equal the reference decode; no chunk of a later group is written
    with anything but the reference's values."""
    from turbowire.codec import Codec
    from turbowire.kernels import DecodeItem, decode_into

    src = gpu_caches(seed=3)
    w = make_worker(monkeypatch, "tq4", True)
    register(w, src, True, monkeypatch=monkeypatch)
    meta = save_meta()
    for name in LAYERS:
        w.save_kv_layer(name, src[name], meta)
    w.wait_for_save(meta)
    save = meta.saves[1]  # request "b": blocks 2 and 3 of its table
    dst_ids = [4, 11, 6, 0]
    load = load_request("d", save, dst_ids, "tq4", PeerAddress("p", "h", 1, 1))
    # READs whose bytes are there when they are posted (prepare below puts them in place)
    attach_loader(w, FakeClient(w.layout, None, engine_id="p", mem_type=w.mem_type),
                  FakeTransport(auto_land=True))
    bad = (0, 1)  # (block position, layer)
    seen = {}
    real_prepare = w.loader.prepare

    def prepare(ld, recv_offset, offsets):  # the READs' bytes, then the GPU path's hook
        for layer in range(len(LAYERS)):
            for bi, b in enumerate(ld.blocks):
                at = w.layout.chunk_offset(b.slot, layer)
                off, size = offsets[(bi, layer)]
                w.recv[recv_offset + off:recv_offset + off + size] = w.staging[at:at + size]
        w.recv[recv_offset + offsets[bad][0] + 80] ^= 0x11
        seen.update(recv_offset=recv_offset, offsets=offsets)
        real_prepare(ld, recv_offset, offsets)

    w.loader.prepare = prepare
    poisoned = gpu_caches(None)
    dst = gpu_caches(None)
    w.caches.tensors[:] = [dst[n] for n in LAYERS]
    w.start_load_kv(TurboWireConnectorMetadata(loads=[load]))
    finished: set[str] = set()
    failed: set[str] = set()
    for _ in range(20):
        f, x = w.get_transfer_results()
        finished |= f
        failed |= x
        if "d" in finished:
            break
    assert finished == {"d"} and failed == {"d"}
    assert w.take_reports().reports["d"].failed == "checksum"
    groups = seen["offsets"].groups
    assert groups is not None and list(groups[0]) == [0, 1]  # the corrupt chunk's group
    # the reference decode of every chunk but the corrupt one
    codec = Codec("tq4", DIM, len(LAYERS))
    want = gpu_caches(None)
    for layer, name in enumerate(LAYERS):
        items = [DecodeItem(dst_ids, b.index * BS, b.num_tokens,
                            seen["recv_offset"] + seen["offsets"][(bi, layer)][0],
                            seen["offsets"][(bi, layer)][1], b.tag)
                 for bi, b in enumerate(load.blocks) if (bi, layer) != bad]
        decode_into(codec, layer, want[name], w.caches.layouts[layer], items, w.recv,
                    impl="reference")
    blk = load.blocks[bad[0]]
    rows = (slice(None), dst_ids[blk.index], slice(0, blk.num_tokens))
    assert bool((dst[LAYERS[bad[1]]][rows] == GUARD).all()), "the corrupt chunk was written"
    for layer in groups[0]:  # its group: every other chunk as the reference decodes it
        assert torch.equal(dst[LAYERS[layer]], want[LAYERS[layer]]), layer
    for layer in range(groups[0].stop, len(LAYERS)):  # later groups: decoded or untouched
        name = LAYERS[layer]
        for bi, b in enumerate(load.blocks):
            r = (slice(None), dst_ids[b.index], slice(0, b.num_tokens))
            assert (torch.equal(dst[name][r], want[name][r])
                    or torch.equal(dst[name][r], poisoned[name][r])), (layer, bi)
    assert not w.coder.decoder.loads and not w.loader.pending


# ---- the loader with GPU decodes (handles that settle later): connector/loader.py
class _Pending:
    """A GPU decode handle: runs when ``ran`` is set (or when waited for)."""

    def __init__(self, log: list, layers: range, refuse: bool) -> None:
        self.log, self.layers, self.refuse, self.ran = log, tuple(layers), refuse, False

    def done(self) -> bool:
        return self.ran

    def result(self) -> None:
        if not self.ran:
            self.log.append(("wait", self.layers))
        self.ran = True
        if self.refuse:
            raise ChecksumError("body checksum mismatch")

    def abandon(self) -> None:
        self.log.append(("abandon", self.layers))


def _loader(refuse_layer: int | None = None):
    from turbowire.codec import Codec
    from turbowire.connector.geometry import KVGeometry, LayerSpec, StagingLayout
    from turbowire.connector.loader import KVLoader, LocalEnd
    from turbowire.connector.staging import ByteRanges
    from turbowire.connector.stats import TurboWireConnectorStats

    n_layers = 4
    config = TurboWireConfig.from_extra_config(
        {"preset": "raw", "decode_pipeline_groups": 4}, environ={})
    geo = KVGeometry(tuple(LayerSpec(f"l.{i}", HEADS, DIM) for i in range(n_layers)), BS,
                     "bfloat16")
    codec = Codec("raw", DIM, n_layers)
    layout = StagingLayout.build(geo, codec.encoded_nbytes, 1 << 20)
    client = FakeClient(layout, None, engine_id="p")
    log: list = []
    handles: list[_Pending] = []

    def decode(load, layers, recv_offset, chunk_offsets):
        log.append(("decode", tuple(layers)))
        handles.append(_Pending(log, layers, refuse_layer in layers))
        return handles[-1]

    def prepare(load, recv_offset, chunk_offsets):
        log.append(("prepare", len(chunk_offsets)))

    wire = FakeTransport()
    local = LocalEnd("d", 0, None, "DRAM", 1 << 30, 0, 64, 2 * HEADS * DIM * 2 * n_layers)
    loader = KVLoader(config, geo, layout,
                      lambda layer, t, i: codec.encoded_nbytes(layer, t, HEADS, i * BS), local,
                      wire, SimpleNamespace(get=lambda host, port: client), ByteRanges(1 << 20),
                      decode, InlineExecutor(), TurboWireConnectorStats(), prepare=prepare)
    load = LoadRequest("r", "remote-r", PeerAddress("p", "h", 1, 1),
                       [LoadBlock(i, 3 + i, BS, i, 9 + i) for i in range(3)], "raw", [3, 4, 5])
    return loader, wire, load, log, handles


def test_the_loader_finishes_a_load_only_once_its_gpu_decodes_ran():
    loader, wire, load, log, handles = _loader()
    loader.start([load])  # the handshake goes out
    assert loader.results() == (set(), set())  # the READs go out
    assert len(wire.reads) == 2 and log == [("prepare", 4 * 3)]  # the plan, while they move
    wire.land(0, 1)
    assert loader.results() == (set(), set())  # group 0 handed over, its decode not run yet
    assert [e for e in log if e[0] == "decode"] == [("decode", (0,))]
    handles[0].ran = True
    wire.land()
    wire.auto_land = True
    wire_posted = len(wire.reads)
    finished, failed = loader.results()
    # every landed group in one decode call (the READs posted meanwhile included), one wait
    assert len(wire.reads) == 4 > wire_posted
    assert [e[1] for e in log if e[0] == "decode"] == [(0,), (1, 2, 3)]
    assert [e for e in log if e[0] == "wait"] == [("wait", (1, 2, 3))]
    assert finished == {"r"} and not failed
    assert loader.take_reports()["r"].failed is None


def test_a_refused_gpu_decode_fails_the_load_and_abandons_the_rest():
    loader, wire, load, log, handles = _loader(refuse_layer=1)
    loader.start([load])
    for _ in range(3):
        wire.land()
        finished, failed = loader.results()
        if failed:
            break
    assert failed == {"r"} and finished == {"r"}
    assert loader.take_reports()["r"].failed == "checksum"
    abandoned = [e[1] for e in log if e[0] == "abandon"]
    # the run decoded after the refused group is queued behind it: never waited for
    assert abandoned == [(2, 3)]
    assert not loader.pending


@pytest.mark.parametrize("gpu", [False, True])
def test_save_schedule_after_forward_encodes_nothing_per_layer_and_everything_at_wait(
        monkeypatch, gpu):
    """``save_schedule: after_forward`` (FULL CUDA graphs skip save_kv_layer on replay): the
    per-layer calls stage nothing, wait_for_save stages what the layerwise path stages."""
    src = gpu_caches(seed=4)
    ref = make_worker(monkeypatch, "tq4", False)
    register(ref, src, False)
    w = make_worker(monkeypatch, "tq4", gpu, save_schedule="after_forward")
    w.register_kv_caches(src)
    if gpu:  # what the worker builds on CUDA caches, forced on the CPU's interpreter
        use_cuda_coder(w, SMALL)
        assert w.coder.mode == "batched"
    meta = save_meta()
    for name in LAYERS:
        ref.save_kv_layer(name, src[name], meta)
    ref.wait_for_save(meta)
    w.staging.fill_(0x5A)
    before = w.staging.clone()
    per_layer: list[int] = []  # the layers save_kv_layer handed to the coder
    save_layer = w.coder.save_layer

    def spy(layer, m):
        per_layer.append(layer)
        return save_layer(layer, m)

    monkeypatch.setattr(w.coder, "save_layer", spy)
    for name in LAYERS:
        w.save_kv_layer(name, src[name], meta)
    assert torch.equal(w.staging, before) and not per_layer
    if gpu:
        assert w.coder._step is None and w.coder._noted is None
    w.wait_for_save(meta)
    written = w.staging != before
    assert written.any()
    assert torch.equal(w.staging[written], ref.staging[written])
    assert sent(w) == sent(ref)


def test_the_connector_asks_for_piecewise_graphs_unless_the_save_is_after_the_forward():
    from turbowire.connector.config import ConnectorConfigError
    from turbowire.connector.connector import TurboWireConnector

    assert TurboWireConnector.requires_piecewise_for_cudagraph({}) is True
    assert TurboWireConnector.requires_piecewise_for_cudagraph(
        {"save_schedule": "layerwise"}) is True
    assert TurboWireConnector.requires_piecewise_for_cudagraph(
        {"preset": "tq4", "save_schedule": "after_forward"}) is False
    with pytest.raises(ConnectorConfigError, match="save_schedule='per_step' is unknown"):
        TurboWireConnector.requires_piecewise_for_cudagraph({"save_schedule": "per_step"})


def test_the_graphs_cover_single_groups_all_layers_and_the_first_reads_then_the_rest():
    from turbowire.connector.loader import layer_groups, likely_runs

    def runs(n_layers, n_groups):
        groups = layer_groups(n_layers, n_groups)
        return [(r.start, r.stop) for r in likely_runs(groups, n_layers)]

    assert runs(32, 8) == [(0, 32), (0, 8), (8, 32)]
    assert runs(5, 3) == [(0, 5), (0, 4)]  # the rest is group 2 alone: captured as a group
    assert runs(4, 2) == [(0, 4)]
    assert runs(4, 1) == []


def test_the_block_chunk_launch_shape_caps_the_encoder_and_leaves_the_decoder_alone():
    """16-token blocks: 2 warps x 16 rows, the encoder capped at BLOCK_ENCODE_REGISTERS (the
    stream specs do not matter for an explicit cap), no cap on every kernel (the decoder);
    larger blocks keep the kernels' default shape."""
    cfg = block_kernel_config(16)
    assert (cfg.num_warps, cfg.tile_rows) == (2, 16)
    assert cfg.encode_registers_for(None, None, 128) == BLOCK_ENCODE_REGISTERS
    assert cfg.max_registers is None
    assert block_kernel_config(32) is None
