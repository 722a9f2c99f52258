"""Prefill and decode at different TP sizes on the GPU path (``decode_tp_size``).

A prefill worker (TP 1, every KV head) told the decode engines' TP size stages each chunk as one
chunk per decode rank's heads through its CUDA coder (``EncodeLayersPlan(head_groups=)``); a
decode rank of TP 2 decodes its run through a head window (the Triton kernels' ``head0`` /
``heads`` columns).

``tp_check``: every staged run equals the reference codec's encode of those heads alone, and each
decode rank's caches equal the reference's decode of its window, nothing else written.
``tp_save``: in paired rounds, what the save adds to a forward with whole chunks and with chunks
cut into runs (2 runs: 4 heads each; 8 runs: one head each, for decode TP 8); then a decode rank's
load of its runs through its coder's decode plans (one per head window), timed whole (plans
built, captured, launched) and from landed (plans prepared while the READs move), and at 4k
tokens the reference's decode, once."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bench.gpu_path import save as save_part
from bench.gpu_path.check import first_mismatch
from bench.gpu_path.fakes import load_request
from bench.gpu_path.rig import (
    BLOCK,
    DEVICE,
    MODEL,
    SMOKE,
    Forward,
    bench_ms,
    fit,
    layer_names,
    make_worker,
    save_meta,
    sync,
    time_once,
    use_coder,
)
from turbowire.codec import Codec
from turbowire.connector.coder import ChunkOffsets
from turbowire.connector.coder.host import decode_landed
from turbowire.connector.read_plan import cut_chunk_sizes, layer_groups
from turbowire.connector.tp_plan import chunk_cut, head_sources
from turbowire.kernels import DecodeItem, EncodeItem, decode_into, encode_into

GUARD = 7.0
DECODE_TP = 2  # the check's decode engine
CUTS = (2, 8)  # the timing's decode TP sizes (runs per chunk, 8 KV heads)


def _pool(codec: Codec, layers: int, heads: int, blocks: int) -> int:
    per_slot = sum(codec.encoded_nbytes(i, BLOCK, heads) + 64 * heads for i in range(layers))
    return max(1 << 20, per_slot * (blocks + 8))


def _prefill(preset: str, tag: str, nb: int, pool: int, layers: int, heads: int, dim: int,
             src: dict[str, torch.Tensor], decode_tp: int) -> Any:
    p = make_worker(preset, "kv_producer", tag, nb, pool, layers, heads, dim,
                    decode_tp_size=decode_tp)
    p.register_kv_caches(src)
    use_coder(p, "layerwise")
    return p


def _reference_runs(p: Any, meta: Any, src: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
    """(layer, block index) of every chunk whose staged runs differ from the reference codec's
    encode of each run's heads alone."""
    groups = p.layout.head_groups
    bad = []
    ref = torch.zeros_like(p.staging)
    for layer, name in enumerate(src):
        sub = p.geometry.layers[layer].num_kv_heads // groups
        for s in meta.saves:
            for b in s.blocks:
                at = p.layout.chunk_offset(b.slot, layer)
                size = p.chunk_nbytes(layer, b.num_tokens, b.index, sub)
                items = [EncodeItem(s.block_ids, b.index * BLOCK, b.num_tokens, at + g * size,
                                    b.tag, head_start=g * sub, head_count=sub)
                         for g in range(groups)]
                encode_into(p.codec, layer, src[name], p.caches.layouts[layer], items, ref,
                            impl="reference")
                end = at + groups * size
                if first_mismatch(p.staging[at:end], ref[at:end]) is not None:
                    bad.append((layer, b.index))
    return bad


@dataclass
class WindowLoad:
    """A decode rank's load of its runs: ``prepare`` is its loader's hook once the READs are
    posted (the coder's decode plans, one per head window, built while the bytes move),
    ``decode`` the landed groups through the coder, ``reference`` the reference codec's decode
    of the same bytes into fresh caches."""

    worker: Any
    caches: dict[str, torch.Tensor]
    prepare: Callable[[], None]
    decode: Callable[[], None]
    reference: Callable[[], dict[str, torch.Tensor]]
    item_path: Callable[[], None]  # the same decode through the per-item calls (the host coder's)


def _decode_rank(p: Any, preset: str, rank: int, decode_tp: int, nb: int, pool: int,
                 save: Any, d_ids: list[int]) -> WindowLoad:
    """Decode rank ``rank`` of a TP ``decode_tp`` engine, its receive buffer holding the runs
    its cut names (as its loader READs them)."""
    layers, heads = p.geometry.num_layers, p.geometry.layers[0].num_kv_heads
    per = heads // decode_tp
    names = layer_names(layers)
    d = make_worker(preset, "kv_consumer", f"D{rank}-{decode_tp}", nb, pool, layers, per,
                    p.codec.head_dim, tp_size=decode_tp)
    dst = {n: torch.full((2, nb, BLOCK, per, p.codec.head_dim), GUARD, device=DEVICE)
           .to(torch.bfloat16) for n in names}
    d.register_kv_caches(dst)
    use_coder(d)
    load = load_request(f"d{rank}", save, d_ids, preset)
    (source,) = head_sources(heads, 1, decode_tp, rank)
    cut = chunk_cut(source, p.layout.head_groups, per)
    assert cut is not None
    sizes, skip = cut_chunk_sizes(
        load.blocks, lambda layer, t, i: d.chunk_nbytes(layer, t, i, heads),
        lambda layer, t, i: d.chunk_nbytes(layer, t, i, cut.sub_heads), [True] * layers,
        cut.first, cut.parts)
    flat = sizes.reshape(-1)
    offsets = ChunkOffsets((np.cumsum(flat) - flat).reshape(sizes.shape), sizes,
                           layer_groups(layers, 4), [])
    for layer in range(layers):
        for bi, b in enumerate(load.blocks):
            off, size = offsets[(bi, layer)]
            at = p.layout.chunk_offset(b.slot, layer) + int(skip[layer, bi])
            d.recv[off:off + size] = p.staging[at:at + size]

    def prepare() -> None:
        d.coder.prepare_load(load, 0, offsets, cut=cut)

    def decode() -> None:
        for group in offsets.groups:
            d.coder.decode(load, group, 0, offsets, cut=cut).result()

    def reference() -> dict[str, torch.Tensor]:
        out = {}
        for layer, name in enumerate(names):
            want = torch.full_like(dst[name], GUARD)
            items = []
            for bi, b in enumerate(load.blocks):
                off, size = offsets[(bi, layer)]
                part = size // cut.parts
                items += [DecodeItem(d_ids, b.index * BLOCK, b.num_tokens, off + i * part, part,
                                     b.tag, heads=w) for i, w in enumerate(cut.windows)]
            decode_into(d.codec, layer, want, d.caches.layouts[layer], items, d.recv,
                        impl="reference")
            out[name] = want
        return out

    def item_path() -> None:
        for group in offsets.groups:
            decode_landed(d.codec, d.geometry, d.caches, d.recv, load, group, 0, offsets, cut)

    return WindowLoad(d, dst, prepare, decode, reference, item_path)


def landed_ms(load: WindowLoad, reps: int) -> float:
    """Median wall ms from a prepared load's bytes landed to its caches decoded (the plans
    built beforehand, as while the READs move)."""
    times = []
    for _ in range(reps):
        load.prepare()
        sync()
        t0 = time.perf_counter()
        load.decode()
        sync()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def tp_check(preset: str, log: Any) -> dict[str, Any]:
    """See the module (``tp_check``); ``ok`` is every part."""
    out: dict[str, Any] = {"preset": preset, "check": "tp_check"}
    layers, heads, dim, nb = (2, 2, 128, 32) if SMOKE else (4, 8, 128, 64)
    ntok = 40 if SMOKE else 300
    n_blocks = -(-ntok // BLOCK)
    names = layer_names(layers)
    codec = Codec(preset, dim, layers)
    pool = _pool(codec, layers, heads, nb)
    g = torch.Generator(device=DEVICE).manual_seed(21)
    src = {n: (torch.randn(2, nb, BLOCK, heads, dim, generator=g, device=DEVICE) * 1.5
               + torch.linspace(-2, 2, dim, device=DEVICE)).to(torch.bfloat16) for n in names}
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(8)).tolist()
    p = _prefill(preset, "P-tp", nb, pool, layers, heads, dim, src, DECODE_TP)
    out["coder"] = type(p.coder).__name__
    out["runs_per_chunk"] = p.layout.head_groups
    meta = save_meta("a", perm[:n_blocks], ntok)
    for name in names[:-1]:  # the last layer is left to wait_for_save
        p.save_kv_layer(name, src[name], meta)
    p.wait_for_save(meta)
    sync()
    bad_runs = _reference_runs(p, meta, src)
    out["runs_bitexact"] = not bad_runs
    bad_decode = []
    d_ids = perm[::-1][:n_blocks]
    for rank in range(DECODE_TP):
        load = _decode_rank(p, preset, rank, DECODE_TP, nb, pool, meta.saves[0], d_ids)
        load.prepare()
        load.decode()
        sync()
        want = load.reference()
        bad_decode += [(rank, n) for n in names
                       if first_mismatch(load.caches[n], want[n]) is not None]
        load.worker.shutdown()
    p.shutdown()
    out["windows_bitexact"] = not bad_decode
    out["mismatch"] = (bad_runs + bad_decode)[:4]
    out["ok"] = bool(out["runs_bitexact"] and out["windows_bitexact"]
                     and out["runs_per_chunk"] == DECODE_TP)
    log(f"[tp check] {preset}: ok={out['ok']} {out['coder']}, {out['runs_per_chunk']} runs per "
        f"chunk {out['mismatch'] or ''}")
    return out


def tp_save(tokens: int, preset: str, rounds: int, log: Any) -> dict[str, Any]:
    """See the module (``tp_save``): the save's share of a forward per cut, and the decode."""
    # the smoke run's model has one KV head: two here, so that a chunk cuts
    layers, heads, dim = MODEL["layers"], 2 if SMOKE else MODEL["kv_heads"], MODEL["head_dim"]
    names = layer_names(layers)
    nblk = -(-tokens // BLOCK)
    nb = nblk + 64
    codec = Codec(preset, dim, layers)
    pool = _pool(codec, layers, heads, nblk)
    g = torch.Generator(device=DEVICE).manual_seed(5)
    src = {n: torch.randn(2, nb, BLOCK, heads, dim, generator=g, device=DEVICE)
           .to(torch.bfloat16) for n in names}
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(7)).tolist()
    p_ids = perm[:nblk]
    t = torch.arange(tokens)
    slot_mapping = (torch.tensor(p_ids)[t // BLOCK] * BLOCK + t % BLOCK).to(DEVICE)
    fwd = Forward(tokens, src, slot_mapping, kv_heads=heads)
    cuts = [c for c in CUTS if heads % c == 0] if not SMOKE else [heads]
    workers = {"whole": _prefill(preset, f"P-{tokens}-1", nb, pool, layers, heads, dim, src, 0)}
    for c in cuts:
        workers[f"cut{c}"] = _prefill(preset, f"P-{tokens}-{c}", nb, pool, layers, heads, dim,
                                      src, c)

    def step(variant: str) -> Any:
        meta = save_meta(f"req-{tokens}", p_ids, tokens)
        if variant == "forward":
            return lambda: fwd.run(None, None)
        return lambda: fwd.run(workers[variant], meta)

    names_v = list(workers)
    for v in ["forward", *names_v]:  # warm: compiled, plans built
        step(v)()
    sync()
    sv = save_part.paired_rounds(step, names_v, rounds)
    fw = statistics.median(sv["forward"])
    r: dict[str, Any] = {"tokens": tokens, "preset": preset, "forward_ms": fw,
                         "rounds": rounds, "aa_pct": 100 * statistics.median(sv["aa"]) / fw}
    for v in names_v:
        r[f"{v}_pct"] = 100 * statistics.median(sv["diff"][v]) / fw
    cut_p = workers[f"cut{cuts[0]}"]
    meta = save_meta(f"req-{tokens}", p_ids, tokens)
    fwd.run(cut_p, meta)
    sync()
    load = _decode_rank(cut_p, preset, 0, cuts[0], nb, pool, meta.saves[0], perm[::-1][:nblk])
    load.prepare()
    load.decode()
    sync()
    r["decode_tp"] = cuts[0]

    def whole_load() -> None:
        load.prepare()
        load.decode()

    r["window_decode_ms"] = bench_ms(whole_load)  # plans built, captured and launched
    r["window_landed_ms"] = landed_ms(load, 3 if SMOKE else rounds)
    r["item_path_ms"] = bench_ms(load.item_path)  # the per-item path the coder took before
    r["reference_decode_ms"] = (time_once(load.reference) if tokens <= 4096 or SMOKE
                                else None)
    load.worker.shutdown()
    for w in workers.values():
        w.shutdown()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    log(f"  {tokens} {preset} tp: forward {fw:.2f} ms, "
        + ", ".join(f"{v} {r[v + '_pct']:+.2f}%" for v in names_v)
        + f", A/A {r['aa_pct']:+.2f}%; rank 0 of TP {cuts[0]} decodes its runs in "
        f"{r['window_decode_ms']:.3f} ms, {r['window_landed_ms']:.3f} ms once landed "
        f"(per-item path {r['item_path_ms']:.3f} ms, reference "
        f"{r['reference_decode_ms'] or 0:.1f} ms)")
    return r


def table(rows: list[dict[str, Any]]) -> str:
    """One line per case (<= 80 columns): the save's share of a forward, whole and cut, the
    A/A noise, a decode rank's load of its windows (plans built and launched; from landed,
    the plans prepared) and the reference's decode (ms)."""
    cols = [("tokens", 6), ("preset", 6), ("fwd_ms", 7), ("whole_%", 7), ("cut2_%", 7),
            ("cut8_%", 7), ("aa_%", 6), ("win_ms", 7), ("land_ms", 7), ("ref_ms", 8)]
    lines = [" ".join(f"{c:>{w}}" for c, w in cols)]
    for r in rows:
        def pct(key: str) -> str:
            return fit(r[key], 7, 2, "+") if key in r else "-"

        ref = r.get("reference_decode_ms")
        cells = [str(r["tokens"]), r["preset"], fit(r["forward_ms"], 7, 2), pct("whole_pct"),
                 pct("cut2_pct"), pct("cut8_pct"), fit(r["aa_pct"], 6, 2, "+"),
                 fit(r["window_decode_ms"], 7, 3), fit(r["window_landed_ms"], 7, 3),
                 "-" if ref is None else fit(ref, 8, 1)]
        lines.append(" ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, cols, strict=True)))
    return "\n".join(lines)
