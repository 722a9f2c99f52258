"""The decode process (cuda:B): the connector's load path, then the dense anchors' READs.

Per round of a preset: the request's blocks are poisoned (last round: the one checked), the
producer is told the consumer is ready, and when its request id arrives the decode engine's
step runs as vLLM runs it: ``start_load_kv`` with the request's ``LoadRequest`` (built here,
from the request id, as the scheduler builds it from the params), then
``get_transfer_results`` back to back until the request is reported (the loader READs the
chunks with its worker's real NIXL agent, layer group by layer group, and decodes each landed
run into the paged cache on the GPU); then the GPU is synchronised and the clock read (t1:
"last layer decoded"). The load's own report gives the READ time (posted -> last READ seen
landed) and the wire bytes. After the last round the decoded layers named by
``--check-layers`` are compared, bit for bit, with the reference codec's decode
(``turbowire.kernels.decode_into(impl="reference")``) of the bytes in the receive buffer.

Anchors: (a) NixlConnector's prepped READ of the request's blocks (anchors.py), its bytes
checked against the producer's digest; (b) the contiguous READ of the same byte count, for
each descriptor count asked.
"""

from __future__ import annotations

import gc
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bench.gpu_pipeline import env

if TYPE_CHECKING:
    import torch

    from bench.gpu_pipeline.case import Case


def main(conn: Any, results: Any, case: Case) -> None:
    """Process entry (the driver starts it): ``run`` reported as ``env.process_main`` does."""
    env.process_main("consumer", run, conn, results, case)


def run(conn: Any, case: Case, part: Callable[[str, Any], None]) -> dict[str, Any]:
    """The phases; each one's result goes to the driver as it ends (``part``): a case cut
    by its time limit keeps the phases it finished."""
    import torch

    from bench.gpu_pipeline.common import block_tables, device_of, expect
    from bench.gpu_pipeline.models import BLOCK, layer_names

    nixl = env.nixl_api()
    device = device_of(case, "consumer")
    m = case.model
    dst = {n: torch.zeros(2, case.cache_blocks, BLOCK, m.kv_heads, m.head_dim, device=device,
                          dtype=torch.bfloat16) for n in layer_names(m.layers)}
    p_ids, d_ids = block_tables(case)
    hello = expect(conn, "hello")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out: dict[str, Any] = {"device": str(device), "gpu": gpu, "producer": hello, "presets": {}}
    for preset in case.presets:
        out["presets"][preset] = load_rounds(conn, case, preset, dst, p_ids, d_ids)
        part(f"presets.{preset}", out["presets"][preset])
    if case.anchors:
        out["anchors"] = anchor_reads(conn, case, nixl, dst, p_ids, d_ids, device, part)
        gc.collect()
    return out


def poison(caches: list[torch.Tensor], block_ids: list[int], value: float) -> None:
    """``value`` in the request's blocks of every layer."""
    import torch

    ids = torch.tensor(block_ids, device=caches[0].device)
    for cache in caches:
        cache[:, ids] = value


def load_rounds(conn: Any, case: Case, preset: str, dst: dict[str, torch.Tensor],
                p_ids: list[int], d_ids: list[int]) -> dict[str, Any]:
    """The preset's rounds (see the module): per round the clock marks and the load's report;
    then the check."""
    import time

    from bench.gpu_path import fakes
    from bench.gpu_pipeline.common import (
        close_worker,
        expect,
        make_worker,
        now_ns,
        sync,
        use_cuda_coder,
    )
    from bench.gpu_pipeline.link import PipeSideChannel
    from bench.gpu_pipeline.models import BLOCK
    from turbowire.connector.metadata import PeerAddress, TurboWireConnectorMetadata

    hello = expect(conn, "tw_hello")
    d = make_worker(case, preset, "kv_consumer", f"D-{preset}-{uuid.uuid4().hex[:6]}")
    d.register_kv_caches(dst)
    use_cuda_coder(d)
    assert d.transport is not None
    fakes.attach_loader(d, PipeSideChannel(hello, d.layout), d.transport)  # type: ignore[arg-type]
    peer = PeerAddress(hello.engine_id, "127.0.0.1", 1, 1)
    rounds: list[dict[str, Any]] = []
    check: dict[str, Any] = {}
    try:
        for i in range(case.rounds):
            if i == case.rounds - 1:
                poison(list(dst.values()), d_ids, 7.0)
                sync()
            if i == case.warmup:
                gc.collect()
                gc.freeze()  # as vLLM's engine core does once started
            conn.send(("ready", None))
            msg = expect(conn, "saved")
            t_recv = now_ns()
            rid = msg["rid"]
            save = fakes.save_request(rid, p_ids, case.tokens, BLOCK)
            load = fakes.load_request(rid, save, d_ids, preset, peer)
            d.start_load_kv(TurboWireConnectorMetadata(loads=[load]))
            finished: set[str] = set()
            failed: set[str] = set()
            polls = 0
            limit = time.monotonic() + case.timeout_s
            while rid not in finished:
                f, x = d.get_transfer_results()
                finished |= f
                failed |= x
                polls += 1
                if time.monotonic() > limit:
                    raise TimeoutError(f"load {rid} not finished after {case.timeout_s} s")
            sync()
            t1 = now_ns()
            d.get_transfer_results()  # the next step: the lease release, the metrics
            reports = d.take_reports()
            report = reports.reports.get(rid) if reports is not None else None
            if rid in failed or report is None or report.failed:
                raise RuntimeError(f"load {rid} failed: {report}")
            rounds.append({"t0": msg["t0"], "t_pub": msg["t_pub"], "t_recv": t_recv, "t1": t1,
                           "polls": polls, "transfer_s": report.transfer_seconds,
                           "decode_s": report.decode_seconds, "wire_bytes": report.wire_bytes,
                           "dense_bytes": report.dense_bytes})
            if i == case.rounds - 1:
                check = reference_check(d, load, d_ids, case.check_layers)
        conn.send(("tw_done", None))
    finally:
        gc.unfreeze()  # the worker's cycles (and its NIXL agent) collectable again
        close_worker(d)
    return {"rounds": rounds, "check": check}


def reference_check(d: Any, load: Any, d_ids: list[int], layers: tuple[int, ...]
                    ) -> dict[str, Any]:
    """The decoded rows of ``layers`` against the reference codec's decode of the received
    chunks (where the loader put them: layer-major from the start of the receive buffer, the
    only load in it; a misplaced chunk fails its tag there)."""
    import torch

    from bench.gpu_pipeline.models import BLOCK
    from turbowire.connector.read_plan import chunk_sizes
    from turbowire.kernels import DecodeItem, decode_into

    sizes = chunk_sizes(load.blocks, d.geometry.num_layers, d.chunk_nbytes)
    flat = sizes.reshape(-1)
    offsets = (flat.cumsum() - flat).reshape(sizes.shape)
    ids = torch.tensor(d_ids, device=d.caches.device)
    equal: dict[int, bool] = {}
    for layer in layers:
        got = d.caches.tensors[layer]
        want = torch.full_like(got, 7.0)
        items = [DecodeItem(d_ids, b.index * BLOCK, b.num_tokens, int(offsets[layer, j]),
                            int(sizes[layer, j]), b.tag) for j, b in enumerate(load.blocks)]
        decode_into(d.codec, layer, want, d.caches.layouts[layer], items, d.recv,
                    impl="reference")
        equal[layer] = bool(torch.equal(got[:, ids].contiguous().view(torch.uint8),
                                        want[:, ids].contiguous().view(torch.uint8)))
    return {"layers": list(layers), "equal": equal, "ok": bool(equal) and all(equal.values())}


def anchor_reads(conn: Any, case: Case, nixl: Any, dst: dict[str, torch.Tensor],
                 p_ids: list[int], d_ids: list[int], device: torch.device,
                 part: Callable[[str, Any], None]) -> dict[str, Any]:
    """(a) then (b), each round timed from the producer's mark to the READ seen done."""
    import torch

    from bench.gpu_pipeline import anchors
    from bench.gpu_pipeline.common import expect, now_ns, sync
    from bench.gpu_pipeline.models import BLOCK

    caches = list(dst.values())
    hello = expect(conn, "anchor_hello")
    mem = anchors.mem_type(device)
    agent = anchors.vllm_style_agent(nixl, f"D-anchor-{uuid.uuid4().hex[:8]}")
    regions = anchors.KVRegions.of(caches)
    regs = [agent.register_memory(agent.get_reg_descs(regions.reg_list(), mem),
                                  backends=["UCX"])]
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(regions.block_descs(),
                                                                          mem))
    peer = agent.add_remote_agent(hello["metadata"])
    peer = peer.decode() if isinstance(peer, bytes) else str(peer)
    remote_regions: anchors.KVRegions = hello["regions"]
    remote = agent.prep_xfer_dlist(peer, agent.get_xfer_descs(remote_regions.block_descs(), mem))
    out: dict[str, Any] = {"descriptors_a": len(remote_regions.bases) * case.num_blocks}

    def timed(read: Any) -> dict[str, Any]:
        conn.send(("ready", None))
        t0 = expect(conn, "go")["t0"]
        t_recv = now_ns()
        r = read()
        sync()
        return {"t0": t0, "t_recv": t_recv, "posted": r.posted_ns, "done": r.done_ns,
                "t1": now_ns(), "descs_after_merge": r.descs_after_merge}

    if "a" in case.anchors:
        rounds = []
        for i in range(case.rounds):
            if i == case.rounds - 1:
                poison(caches, d_ids, 0.0)
                sync()

            def read_a(i: int = i) -> anchors.ReadResult:
                # the desc ids per request, as NixlConnector computes them in _read_blocks
                return anchors.prepped_read(agent, local, regions.desc_ids(d_ids), remote,
                                            remote_regions.desc_ids(p_ids),
                                            f"anchor-a-{i}:1".encode(), case.timeout_s)

            rounds.append(timed(read_a))
        digest = anchors.blocks_digest(caches, d_ids, list(case.check_layers), case.tokens,
                                       BLOCK)
        out["a"] = {"rounds": rounds, "check": {"layers": list(case.check_layers),
                                                "ok": digest == hello["digest"]}}
        part("anchors", out)
    if "b" in case.anchors:
        addr, dense, dev = hello["contig"]
        buf = torch.zeros(dense, dtype=torch.uint8, device=device)
        regs.append(agent.register_memory(buf, backends=["UCX"]))
        out["b"] = {}
        for pieces in case.contig_descs:
            lrows = anchors.contiguous_rows(buf.data_ptr(), dense, anchors.device_id(device),
                                            pieces)
            rrows = anchors.contiguous_rows(addr, dense, dev, pieces)
            out["b"][pieces] = {"rounds": [timed(lambda: anchors.contiguous_read(
                agent, peer, lrows, rrows, mem, case.timeout_s)) for _ in range(case.rounds)]}
            part("anchors", out)
    conn.send(("anchor_done", None))
    for handle in (local, remote):
        agent.release_dlist_handle(handle)
    agent.remove_remote_agent(peer)
    for reg in regs:
        agent.deregister_memory(reg, backends=["UCX"])
    return out  # the agent goes with this frame (run collects)
