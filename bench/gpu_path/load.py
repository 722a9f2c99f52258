"""Decode: the same request loaded by the decode worker's loader vs the one-launch decode.

A load's bytes are in the receive buffer already; its READs are held on the fake "wire" until
every one lands at one instant, then the worker is polled as vLLM polls it until
``get_transfer_results`` reports the request: landed -> finished is the path's own cost. Also:
READs done when posted (``start_load_kv`` to finished: plan build and graph captures included)
and the first two READs landing, a poll, then the rest. The one-launch decode is the kernels'
``DecodeLayersPlan`` of the same bytes (the fused verify + decode of every chunk, one launch per
layer policy). Every load's result is compared with it; a few chunks with the reference codec.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bench.gpu_path.check import first_mismatch
from bench.gpu_path.fakes import FakeTransport
from bench.gpu_path.rig import BLOCK, SMOKE, bench_ms, load_meta, sync
from turbowire.connector import probe
from turbowire.connector.coder import ChunkOffsets
from turbowire.connector.metadata import SaveRequest
from turbowire.connector.worker import TurboWireWorker
from turbowire.kernels import ChunkSet, DecodeItem, DecodeLayersPlan, KernelConfig, decode_into

# --decode-variants: other launch shapes of the one-launch decode, timed at <= 8k tokens
DECODE_VARIANTS: dict[str, dict[str, Any]] = {
    "split2": dict(num_warps=2, tile_rows=16, decode_split=2),  # one program per stream
    "w1-t16": dict(num_warps=1, tile_rows=16),
    "w4": dict(num_warps=4),  # the kernels' default shape (32-row tiles)
}


@dataclass
class LoadRig:
    """The decode worker with the request's bytes in its receive buffer, and the references."""

    d: TurboWireWorker
    transport: FakeTransport
    save: SaveRequest
    rid: str  # the prefill's request id the loads name
    preset: str
    block_ids: list[int]  # where the decode worker's cache takes the blocks
    offsets: ChunkOffsets
    names: list[str]
    ref: dict[str, torch.Tensor]  # the one-launch decode's caches

    def one_launch_plan(self, config: KernelConfig | None) -> DecodeLayersPlan:
        d, s = self.d, self.save
        assert d.caches is not None and d.recv is not None
        chunks = ChunkSet([self.block_ids], np.zeros(len(s.blocks), np.int64),
                          [b.index * BLOCK for b in s.blocks], [b.num_tokens for b in s.blocks],
                          [b.tag for b in s.blocks])
        return DecodeLayersPlan(d.codec, range(len(self.names)), d.caches.tensors,
                                d.caches.layouts[0], chunks, self.offsets.offsets,
                                self.offsets.sizes, d.recv, config)

    def poison(self) -> None:
        """7.0 in the rows a load writes (a partial block's tail keeps the reference's)."""
        assert self.d.caches is not None
        last = self.save.blocks[-1]
        last_id, last_nt = self.block_ids[last.index], last.num_tokens
        loaded = torch.tensor(self.block_ids, device=self.d.caches.device)
        for layer, n in enumerate(self.names):
            cache = self.d.caches.tensors[layer]
            cache[:, loaded] = 7.0
            cache[:, last_id, last_nt:] = self.ref[n][:, last_id, last_nt:]

    def equal_reference(self) -> bool:
        assert self.d.caches is not None
        return all(first_mismatch(self.d.caches.tensors[i], self.ref[n]) is None
                   for i, n in enumerate(self.names))


def build(d: TurboWireWorker, transport: FakeTransport, save: SaveRequest, rid: str,
          preset: str, block_ids: list[int], offsets: ChunkOffsets,
          names: list[str]) -> LoadRig:
    """Decode the landed bytes once with the one-launch decode: the loads' reference."""
    assert d.caches is not None
    rig = LoadRig(d, transport, save, rid, preset, block_ids, offsets, names, {})
    plan = rig.one_launch_plan(getattr(d.coder, "kernel_config", None))  # the loads' shape
    plan.launch()
    plan.check()
    sync()
    rig.ref = {n: d.caches.tensors[i].clone() for i, n in enumerate(names)}
    return rig


def load_once(rig: LoadRig, rid: str, hold: bool, two_polls: bool = False,
              marks: list[tuple[str, int, int]] | None = None) -> dict[str, float]:
    """One load (see the module); times in ms from the landing (``hold``) or the post.
    ``marks``: the probe's spans of the load land here (``coder.launch``: its launches)."""
    d, t = rig.d, rig.transport
    lm = load_meta(rid, rig.save, rig.block_ids, rig.preset)
    spans: list[tuple[str, int, int]] = []
    gc_ns: list[int] = [0, 0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_ns[0] = time.perf_counter_ns()
        else:
            gc_ns[1] += time.perf_counter_ns() - gc_ns[0]

    sync()
    t.reads.clear()  # this load's READs from 0 (the earlier loads' all landed)
    held = hold or two_polls
    t.auto_land = not held  # held: pending until they land below
    with probe.recording(lambda name, a, b: spans.append((name, a, b))):
        t0 = time.perf_counter_ns()
        d.start_load_kv(lm)
        t1 = time.perf_counter_ns()
        gc.callbacks.append(on_gc)
        if held:  # the READs posted land at one instant (two polls: the first two, a poll)
            t.land(0, 2 if two_polls else None)
            t.auto_land = not two_polls
        t2 = time.perf_counter_ns()
        fin, failed = set(), set()
        if two_polls:
            fin, failed = d.get_transfer_results()
            t.land()
            t.auto_land = True
        while rid not in fin:
            f, x = d.get_transfer_results()
            fin |= f
            failed |= x
        t3 = time.perf_counter_ns()
        gc.callbacks.remove(on_gc)
    if failed:
        raise RuntimeError(f"load {rid} failed: {d.take_reports()}")
    # the engine's next step (vLLM polls every step): the finished load's lease release and
    # metrics go out there, not inside the next load's window
    d.get_transfer_results()
    reports = d.take_reports()
    assert reports is not None
    base = t2 if hold else t0
    launches = [(a, b) for name, a, b in spans if name == "coder.launch"]
    out = {"post": (t1 - t0) / 1e6, "landed": (t3 - t2) / 1e6, "total": (t3 - t0) / 1e6,
           "decode": reports.reports[rid].decode_seconds * 1e3, "launches": len(launches),
           "gc_ms": gc_ns[1] / 1e6}
    if launches:
        out["to_first_launch"] = (launches[0][0] - base) / 1e6
        out["launch_host"] = sum(b - a for a, b in launches) / 1e6
        out["after_last_launch"] = (t3 - launches[-1][1]) / 1e6
    if marks is not None:
        marks += [(name, a - base, b - base) for name, a, b in spans]
    return out


def median(rows: list[dict[str, float]], key: str) -> float | None:
    vals = [x[key] for x in rows if key in x]
    return statistics.median(vals) if vals else None


def run_load(rig: LoadRig, loads: int) -> dict[str, Any]:
    """Warm loads, then held loads, loads done when posted and two-poll loads, each checked
    against the one-launch decode; then the one-launch decode itself."""
    for i in range(1 if SMOKE else 3):
        load_once(rig, f"w{i}", True)  # handshake, compile, graphs warm
        load_once(rig, f"n{i}", False)
    r: dict[str, Any] = {}
    runs: dict[str, list[dict[str, float]]] = {}
    graphs = getattr(getattr(rig.d.coder, "decoder", None), "graphs", None)  # CUDA coder's
    replays0 = graphs.replays if graphs is not None else 0
    for kind, hold, two in (("held", True, False), ("at_once", False, False),
                            ("two_polls", True, True)):
        rig.poison()
        runs[kind] = [load_once(rig, f"{kind}{i}", hold, two) for i in range(loads)]
        r[f"decode_equal_{kind}_loads"] = rig.equal_reference()
    held = runs["held"]
    if graphs is not None:  # 0 replays: the loads launched directly (a capture failed)
        r["load_graph_replays"] = graphs.replays - replays0
        r["load_graphs_enabled"] = graphs.enabled
    r["load_ms"] = median(held, "landed")  # bytes landed -> finished: the path's own cost
    r["load_post_ms"] = median(held, "post")  # start_load_kv: READs posted, plan prepared
    r["load_to_first_launch_ms"] = median(held, "to_first_launch")
    r["load_launch_host_ms"] = median(held, "launch_host")
    r["load_after_last_launch_ms"] = median(held, "after_last_launch")
    r["load_launches"] = median(held, "launches")
    r["load_decode_groups_ms"] = median(held, "decode")
    r["load_gc_worst_ms"] = max(x["gc_ms"] for x in held)
    r["load_spread_ms"] = [min(x["landed"] for x in held), max(x["landed"] for x in held)]
    r["load_all_at_once_ms"] = median(runs["at_once"], "total")
    r["load_two_polls_ms"] = median(runs["two_polls"], "landed")
    r["load_two_polls_launches"] = median(runs["two_polls"], "launches")
    builds = []
    for _ in range(3):
        t0 = time.perf_counter()
        plan = rig.one_launch_plan(getattr(rig.d.coder, "kernel_config", None))
        builds.append((time.perf_counter() - t0) * 1e3)
    r["host_ms_load_plan_build"] = statistics.median(builds)
    plan.launch()
    plan.check()
    r["decode_one_launch_ms"] = bench_ms(plan.launch)
    r["load_vs_one_launch"] = r["load_ms"] / r["decode_one_launch_ms"]
    r["load_all_at_once_vs_one_launch"] = r["load_all_at_once_ms"] / r["decode_one_launch_ms"]
    return r


def decode_variants(rig: LoadRig, names: list[str], log: Callable[[str], None]) -> dict:
    """Other launch shapes of the one-launch decode, each checked against the default's."""
    out: dict[str, Any] = {}
    for name in names:
        try:
            plan = rig.one_launch_plan(KernelConfig(**DECODE_VARIANTS[name]))
            rig.poison()
            plan.launch()
            plan.check()
            sync()
            out[name] = {"ms": bench_ms(plan.launch), "equal": rig.equal_reference()}
        except Exception as exc:  # noqa: BLE001 - a shape that does not build is reported
            out[name] = {"error": repr(exc)[:300], "equal": False}
        log(f"  decode variant {name}: {out[name]}")
    return out


def spot_check(rig: LoadRig, encoded_equal: Callable[[list[int], int], bool]) -> dict[str, Any]:
    """A few chunks (first blocks, last block; first and last layer) against the reference
    codec: staged bytes equal to its encode (``encoded_equal(block positions, layer)``), the
    loads' decoded rows equal to its decode of the landed bytes."""
    d, s = rig.d, rig.save
    assert d.caches is not None and d.recv is not None
    pick = sorted({0, 1, 2, len(s.blocks) - 1} & set(range(len(s.blocks))))
    enc_ok = dec_ok = True
    for layer in (0, len(rig.names) - 1):
        enc_ok &= encoded_equal(pick, layer)
        dst = torch.full_like(d.caches.tensors[layer], 7.0)
        items = [DecodeItem(rig.block_ids, s.blocks[bi].index * BLOCK, s.blocks[bi].num_tokens,
                            *rig.offsets[(bi, layer)], s.blocks[bi].tag) for bi in pick]
        decode_into(d.codec, layer, dst, d.caches.layouts[layer], items, d.recv,
                    impl="reference")
        for bi in pick:
            bid, nt = rig.block_ids[s.blocks[bi].index], s.blocks[bi].num_tokens
            dec_ok &= first_mismatch(dst[:, bid, :nt],
                                     rig.ref[rig.names[layer]][:, bid, :nt]) is None
    return {"chunks": 2 * len(pick), "encode_equal_reference": enc_ok,
            "decode_equal_reference": dec_ok, "smoke": SMOKE}
