"""Bit-exactness on this device: the connector's path against the reference codec.

A small model (4 layers, 8 KV heads, hd128; smoke: 2 x 1), two requests (one partial block, one
starting mid-sequence), per-layer and one-launch saves: staged chunks byte-equal to the
reference encode; request "a" loaded by a decode worker's loader (2 layer groups) equal to the
reference decode of the same bytes; a corrupt chunk refused (the load fails, nothing of that
chunk written, the rest of its group equal to the reference decode). The store path: blobs of
the CUDA coder equal to the host coder's.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import torch

from bench.gpu_path.rig import (
    BLOCK,
    DEVICE,
    SMOKE,
    attach_loader,
    drain,
    fill_recv,
    layer_names,
    load_meta,
    make_worker,
    save_meta,
    sync,
    use_coder,
)
from turbowire.codec import Codec
from turbowire.kernels import DecodeItem, EncodeItem, decode_into, encode_into

Log = Callable[[str], None]


def first_mismatch(got: torch.Tensor, want: torch.Tensor) -> int | None:
    """Index of the first element where ``got`` differs from ``want`` (bitwise, any dtype), or
    None when they are equal; a shape mismatch is index 0."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return 0
    a = got.reshape(-1).view(torch.uint8) if got.dtype != torch.uint8 else got.reshape(-1)
    b = want.reshape(-1).view(torch.uint8) if want.dtype != torch.uint8 else want.reshape(-1)
    diff = torch.nonzero(a != b)
    return None if diff.numel() == 0 else int(diff[0, 0]) // max(1, got.element_size())


def reference_staging(p: Any, meta: Any, names: list[str],
                      src: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor, int, int]]:
    """The reference codec's encode of every chunk of ``meta``: (label, bytes, offset, n)."""
    ref = torch.zeros_like(p.staging)
    out = []
    for layer, name in enumerate(names):
        items = [EncodeItem(s.block_ids, b.index * BLOCK, b.num_tokens,
                            p.layout.chunk_offset(b.slot, layer), b.tag)
                 for s in meta.saves for b in s.blocks]
        written = encode_into(p.codec, layer, src[name], p.caches.layouts[layer], items, ref,
                              impl="reference")
        for it, n in zip(items, written, strict=True):
            out.append((f"layer {layer} token {it.token_start}", ref, it.out_offset, int(n)))
    return out


def reference_decode(d: Any, save: Any, offsets: Any, dids: list[int], names: list[str],
                     fill: float) -> dict[str, torch.Tensor]:
    """The reference codec's decode of a load's landed chunks into caches filled with ``fill``."""
    out = {}
    for layer, name in enumerate(names):
        dst = torch.full_like(d.caches.tensors[layer], fill)
        items = [DecodeItem(dids, b.index * BLOCK, b.num_tokens, offsets[(bi, layer)][0],
                            offsets[(bi, layer)][1], b.tag) for bi, b in enumerate(save.blocks)]
        decode_into(d.codec, layer, dst, d.caches.layouts[layer], items, d.recv,
                    impl="reference")
        out[name] = dst
    return out


def connector_check(preset: str, log: Log) -> dict[str, Any]:
    """See the module; ``ok`` is every part."""
    out: dict[str, Any] = {"preset": preset}
    layers, heads, dim, nb = (2, 1, 128, 64) if SMOKE else (4, 8, 128, 64)
    ntok_a, ntok_b = (20, 40) if SMOKE else (300, 200)
    names = layer_names(layers)
    g = torch.Generator(device=DEVICE).manual_seed(11)
    src = {n: (torch.randn(2, nb, BLOCK, heads, dim, generator=g, device=DEVICE) * 1.5
               + torch.linspace(-2, 2, dim, device=DEVICE)).to(torch.bfloat16) for n in names}
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(3)).tolist()
    meta = save_meta("a", perm[:20], ntok_a)
    sb = save_meta("b", perm[20:40], ntok_b, slot0=len(meta.saves[0].blocks)).saves[0]
    sb.blocks = sb.blocks[2:]  # "b" computed its first 2 blocks in an earlier step
    meta.saves.append(sb)
    # room for both requests' 38 blocks whatever the preset (raw's slots are the largest)
    codec = Codec(preset, dim, layers)
    pool = max(8 << 20, 48 * sum(codec.encoded_nbytes(i, BLOCK, heads) + 64
                                 for i in range(layers)))
    producers = {}
    for schedule in ("layerwise", "after_forward"):
        p = make_worker(preset, "kv_producer", f"P-check-{schedule}", nb, pool, layers,
                        heads, dim)
        p.register_kv_caches(src)
        use_coder(p, schedule)
        for name in names[:-1]:  # the last layer is left to wait_for_save
            p.save_kv_layer(name, src[name], meta)
        p.wait_for_save(meta)
        sync()
        producers[schedule] = p
    p = producers["layerwise"]
    bad = [f"{schedule} {label}" for label, ref, at, n in reference_staging(p, meta, names, src)
           for schedule, w in producers.items()
           if first_mismatch(w.staging[at:at + n], ref[at:at + n]) is not None]
    out["encode_bitexact"] = not bad
    out["encode_mismatch"] = bad[:4]
    # decode request "a" (then a corrupt copy) through a decode worker's loader, 2 layer groups
    d = make_worker(preset, "kv_consumer", "D-check", nb, pool, layers, heads, dim, groups=2)
    dst = {n: torch.full((2, nb, BLOCK, heads, dim), 7.0, device=DEVICE).to(torch.bfloat16)
           for n in names}
    d.register_kv_caches(dst)
    use_coder(d)
    attach_loader(d, p)
    save, dids = meta.saves[0], perm[40:60]
    offsets = fill_recv(d, p, save)
    d.start_load_kv(load_meta("da", save, dids, preset))
    fin, failed = drain(d)
    ref_dst = reference_decode(d, save, offsets, dids, names, 7.0)
    out["load_finished"] = fin == {"da"} and not failed
    out["decode_bitexact"] = all(first_mismatch(dst[n], ref_dst[n]) is None for n in names)
    # a body byte of the last layer's block 1, in a group of several chunks: the load fails as
    # a whole (vLLM recomputes), nothing of that chunk is written, the group's other chunks are
    at = offsets[(1, layers - 1)][0] + 100
    d.recv[at] ^= 0x40
    for n in names:
        dst[n].fill_(7.0)
    d.start_load_kv(load_meta("db", save, dids, preset))
    fin, failed = drain(d)
    reports = d.take_reports()
    report = reports.reports.get("db") if reports is not None else None
    out["corruption_refused"] = (failed == {"db"} and report is not None
                                 and report.failed == "checksum")
    blk = save.blocks[1]
    rows = (slice(None), dids[blk.index], slice(0, blk.num_tokens))
    out["corrupt_chunk_untouched"] = bool((dst[names[-1]][rows].float() == 7.0).all())
    want = ref_dst[names[-1]].clone()
    want[rows] = 7.0
    out["corrupt_group_rest_equal_reference"] = first_mismatch(dst[names[-1]], want) is None
    out["other_layers_reference_or_untouched"] = all(
        bool(((dst[n] == ref_dst[n]) | (dst[n].float() == 7.0)).all()) for n in names)
    parts = ("encode_bitexact", "load_finished", "decode_bitexact", "corruption_refused",
             "corrupt_chunk_untouched", "corrupt_group_rest_equal_reference",
             "other_layers_reference_or_untouched")
    out["ok"] = all(bool(out[k]) for k in parts)
    log(f"[connector check] {preset}: {json.dumps(out)}")
    for w in (*producers.values(), d):
        w.shutdown()
    return out


class MemStore:
    """An in-memory chunk store (the LMCache tiers' put/get)."""

    def __init__(self) -> None:
        self.blobs: dict[tuple[bytes, int], bytes] = {}

    def put(self, scope: Any, chunk_hash: bytes, rank: int, data: bytes,
            on_done: Any = None) -> bool:
        self.blobs[(chunk_hash, rank)] = bytes(data)
        if on_done is not None:
            on_done(True, None)
        return True

    def get(self, scope: Any, chunk_hash: bytes, rank: int) -> bytes | None:
        return self.blobs.get((chunk_hash, rank))

    def close(self) -> None:
        pass


def store_check(preset: str, log: Log) -> dict[str, Any]:
    """The store path's save of a step through the CUDA coder (a side stream, pinned copies)
    and through the host coder: the same blobs."""
    from turbowire.connector.config import TurboWireConfig
    from turbowire.connector.metadata import StoreChunk, StoreSave
    from turbowire.connector.stats import TurboWireConnectorStats
    from turbowire.connector.store_worker import StoreWorker
    from turbowire.store.keys import StoreScope

    layers, heads, dim, nb = (2, 1, 128, 32) if SMOKE else (4, 8, 128, 64)
    chunk = 32 if SMOKE else 256
    g = torch.Generator(device=DEVICE).manual_seed(13)
    src = {n: torch.randn(2, nb, BLOCK, heads, dim, generator=g, device=DEVICE)
           .to(torch.bfloat16) for n in layer_names(layers)}
    p = make_worker(preset, "kv_producer", f"P-store-{preset}", nb, 8 << 20, layers, heads, dim)
    p.register_kv_caches(src)
    assert p.caches is not None
    ids = torch.randperm(nb, generator=torch.Generator().manual_seed(2)).tolist()
    cfg = TurboWireConfig(transport="store", store_chunk_tokens=chunk, preset=preset)
    scope = StoreScope("bench", "llama", preset, 1, chunk, 1)
    starts = [0, chunk] if SMOKE else [0, chunk, 3 * chunk]
    saves = [StoreSave("r", ids, [StoreChunk(t, hashlib.sha256(str(t).encode()).digest()[:16])
                                  for t in starts])]
    blobs = {}
    for kind in ("cuda", "host"):
        st = MemStore()
        w = StoreWorker(cfg, p.geometry, p.codec, scope, 0, p.caches, TurboWireConnectorStats(),
                        store=st, directory=None, coder=p.make_coder(kind))
        w.save(saves)
        w.close()  # waits for the background stores
        blobs[kind] = st.blobs
    out = {"preset": preset, "blobs": len(blobs["cuda"]),
           "ok": bool(blobs["cuda"] == blobs["host"] and len(blobs["cuda"]) == len(starts))}
    log(f"[store check] {preset}: {json.dumps(out)}")
    p.shutdown()
    return out
