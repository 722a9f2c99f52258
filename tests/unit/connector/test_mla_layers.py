"""An MLA model (DeepSeek V2/V3) through the worker's own calls (CPU caches, the host coder): each
layer's cache rows move as latent chunks (the latent coded with the preset's key stream, the
RoPE part raw) into the decode engine's own blocks; the geometry is read from vLLM's own
``MLAAttentionSpec``, and what is not served is refused at start by name."""

from __future__ import annotations

import pytest
import torch
from support.fakes import load_request, save_request
from support.fakes import make_worker as build_worker

from bench.gpu_path.fakes import stand_in_configs
from turbowire.connector.coder import ChunkOffsets
from turbowire.connector.geometry import GeometryError, KVGeometry
from turbowire.connector.metadata import PeerAddress, TurboWireConnectorMetadata
from turbowire.connector.read_plan import chunk_sizes, layer_groups
from turbowire.kernels import LatentPages

BS, L, R, NB = 16, 512, 64, 12
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
TOKENS = 3 * BS - 5
P_IDS, D_IDS = [3, 7, 1], [4, 11, 6]


def worker(monkeypatch, preset: str, engine_id: str, caches: dict, **extra):
    w = build_worker(monkeypatch, {"preset": preset, "staging_bytes": "1MiB", **extra}, LAYERS,
                     block_size=BS, num_kv_heads=1, head_size=L + R, num_blocks=NB,
                     engine_id=engine_id, mla_rope_dim=R)
    w.register_kv_caches(caches)
    return w


def caches(seed: int) -> dict:
    """Each layer's cache as vLLM registers an MLA cache: [num_blocks, 1, block_size, width]."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn((NB, 1, BS, L + R), generator=g).to(torch.bfloat16) for n in LAYERS}


@pytest.mark.parametrize("preset", ["raw", "tq4"])
def test_latent_rows_move_into_the_decode_engines_blocks(monkeypatch, preset):
    src = caches(1)
    p = worker(monkeypatch, preset, "p", src)
    assert p.coder.__class__.__name__ == "HostCoder"
    assert all(layer.is_latent and layer.latent_dim == L and layer.rope_dim == R
               for layer in p.geometry.layers)
    assert p.caches.dense_bytes_per_token() == 3 * (L + R) * 2
    assert isinstance(p.caches.layouts[0], LatentPages)
    save = save_request("a", P_IDS, TOKENS, BS)
    p.wait_for_save(TurboWireConnectorMetadata(saves=[save]))

    dst = caches(2)
    before = {n: t.clone() for n, t in dst.items()}
    d = worker(monkeypatch, preset, "d", dst)
    load = load_request("d", save, D_IDS, preset, PeerAddress("p", "h", 1, 1))
    sizes = chunk_sizes(load.blocks, 3, d.chunk_nbytes)
    flat = sizes.reshape(-1)
    offsets = ChunkOffsets((flat.cumsum() - flat).reshape(sizes.shape), sizes,
                           layer_groups(3, 3), [])
    for layer in range(3):
        for bi, b in enumerate(load.blocks):
            off, size = offsets[(bi, layer)]
            at = p.layout.chunk_offset(b.slot, layer)
            d.recv[off:off + size] = p.staging[at:at + size]
    for layers in offsets.groups:
        d.coder.decode(load, layers, 0, offsets).result()
    last = TOKENS - 2 * BS
    src = {n: t[:, 0] for n, t in src.items()}
    dst = {n: t[:, 0] for n, t in dst.items()}
    before = {n: t[:, 0] for n, t in before.items()}
    for n in LAYERS:
        want = torch.cat([src[n][P_IDS[0]], src[n][P_IDS[1]], src[n][P_IDS[2]][:last]])
        got = torch.cat([dst[n][D_IDS[0]], dst[n][D_IDS[1]], dst[n][D_IDS[2]][:last]])
        assert torch.equal(got[:, L:], want[:, L:]), n  # the RoPE part: raw
        if preset == "raw":
            assert torch.equal(got, want), n
        else:
            err = (got[:, :L].float() - want[:, :L].float()).norm() / want[:, :L].float().norm()
            assert 0 < err < 0.12, (n, err)
        others = [b for b in range(NB) if b not in D_IDS]
        assert torch.equal(dst[n][others], before[n][others]), n
        assert torch.equal(dst[n][D_IDS[2]][last:], before[n][D_IDS[2]][last:]), n


def geometry(**kw) -> KVGeometry:
    shape = dict(block_size=BS, num_kv_heads=1, head_size=L + R, num_blocks=NB, engine_id="e",
                 mla_rope_dim=R)
    shape.update(kw)
    _, kcfg = stand_in_configs({}, LAYERS, **shape)
    return kcfg


def test_the_geometry_reads_vllms_mla_spec_and_refuses_what_it_does_not_serve():
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    kcfg = geometry()
    geo = KVGeometry.from_kv_cache_config(kcfg, mla_rope_dim=R)
    assert geo.has_latent and geo.head_dim == 128 and geo.max_kv_heads == L // 128
    with pytest.raises(GeometryError, match="qk_rope_head_dim"):
        KVGeometry.from_kv_cache_config(kcfg)  # the model config names no RoPE width
    with pytest.raises(GeometryError, match="draft KV"):
        KVGeometry.from_kv_cache_config(kcfg, lambda name: name.endswith("2.self_attn.attn"),
                                        mla_rope_dim=R)
    # a drafter of another kind (an EAGLE head's plain attention) beside the MLA target too
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    eagle = "model.layers.3.self_attn.attn"
    kcfg.kv_cache_groups.append(KVCacheGroupSpec([eagle], FullAttentionSpec(
        block_size=BS, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)))
    with pytest.raises(GeometryError, match="draft KV"):
        KVGeometry.from_kv_cache_config(kcfg, lambda name: name == eagle, mla_rope_dim=R)
    kcfg.kv_cache_groups.pop()
    fp8 = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=656, dtype=torch.uint8,
                           cache_dtype_str="fp8_ds_mla")
    kcfg.kv_cache_groups[0].kv_cache_spec = fp8
    with pytest.raises(GeometryError, match="kv-cache-dtype auto"):
        KVGeometry.from_kv_cache_config(kcfg, mla_rope_dim=R)


def test_the_cuda_coder_refuses_an_mla_model(monkeypatch):
    """The host coder (the reference's latent path) serves MLA on any device; the store path
    too (tests/unit/connector/test_store_path.py)."""
    w = worker(monkeypatch, "tq4", "w", caches(1))
    with pytest.raises(ValueError, match="MLA latents"):
        w.make_coder("cuda")
