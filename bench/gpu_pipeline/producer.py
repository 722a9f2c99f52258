"""The prefill process (cuda:A): the stand-in forward with the connector's per-layer saves, then
the dense anchors' source side.

Per round of a preset: the consumer says it is ready; the forward runs with
``save_kv_layer`` after each layer's KV write (the CUDA coder encodes on its side stream while
the next layers compute); after the last layer the forward stream is synchronised and the
clock read (t0: "last layer computed"); ``wait_for_save`` (the forward stream waits for the
encodes), a synchronisation of the forward stream (vLLM's step ends with the sampled tokens on
the host) and the clock (t_pub); then the request id goes to the consumer, as the proxy would
hand it the params. The staging pool is registered with the worker's own NIXL agent.

Anchors: an agent configured as vLLM's (anchors.py) registers the caches' K and V regions and a
contiguous buffer of the request's dense size; per round, once the consumer is ready, a
synchronised clock mark (t0) goes to it. No forward runs for them: nothing of theirs overlaps
one, and their bytes are in the cache when the forward ends.
"""

from __future__ import annotations

import gc
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bench.gpu_pipeline import env

if TYPE_CHECKING:
    import torch

    from bench.gpu_pipeline.case import Case
    from bench.gpu_pipeline.models import Forward


def main(conn: Any, results: Any, case: Case) -> None:
    """Process entry (the driver starts it): ``run`` reported as ``env.process_main`` does."""
    env.process_main("producer", run, conn, results, case)


def run(conn: Any, case: Case, part: Callable[[str, Any], None]) -> dict[str, Any]:
    """The phases; each one's result goes to the driver as it ends (``part``): a case cut
    by its time limit keeps the phases it finished."""
    import torch

    from bench.gpu_pipeline.common import block_tables, device_of
    from bench.gpu_pipeline.models import BLOCK, Forward, layer_names

    nixl = env.nixl_api()
    device = device_of(case, "producer")
    m = case.model
    g = torch.Generator(device=device).manual_seed(5)
    src = {n: torch.randn(2, case.cache_blocks, BLOCK, m.kv_heads, m.head_dim, generator=g,
                          device=device).to(torch.bfloat16) for n in layer_names(m.layers)}
    p_ids, _ = block_tables(case)
    t = torch.arange(case.tokens)
    slot_mapping = (torch.tensor(p_ids)[t // BLOCK] * BLOCK + t % BLOCK).to(device)
    fwd = Forward(m, case.tokens, src, slot_mapping, device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    conn.send(("hello", {"device": str(device), "gpu": gpu}))
    out: dict[str, Any] = {"device": str(device), "gpu": gpu, "presets": {}}
    for preset in case.presets:
        out["presets"][preset] = save_rounds(conn, case, preset, src, fwd, p_ids)
        part(f"presets.{preset}", out["presets"][preset])
    if case.anchors:
        out["anchors"] = anchor_source(conn, case, nixl, src, p_ids, device)
        part("anchors", out["anchors"])
        gc.collect()  # the anchors' agent
    return out


def save_rounds(conn: Any, case: Case, preset: str, src: dict[str, torch.Tensor],
                fwd: Forward, p_ids: list[int]) -> dict[str, Any]:
    """The preset's rounds (see the module); forward ms per round (start -> t0)."""
    from bench.gpu_path import fakes
    from bench.gpu_pipeline.common import (
        close_worker,
        expect,
        make_worker,
        now_ns,
        stream_sync,
        sync,
        use_cuda_coder,
    )
    from bench.gpu_pipeline.link import ProducerHello
    from bench.gpu_pipeline.models import BLOCK
    from turbowire.connector.metadata import TurboWireConnectorMetadata

    w = make_worker(case, preset, "kv_producer", f"P-{preset}-{uuid.uuid4().hex[:6]}")
    w.register_kv_caches(src)
    use_cuda_coder(w)
    conn.send(("tw_hello", ProducerHello.of(w)))
    forward_ms: list[float] = []
    try:
        for i in range(case.rounds):
            expect(conn, "ready")
            rid = f"{preset}-{i}"
            meta = TurboWireConnectorMetadata(
                saves=[fakes.save_request(rid, p_ids, case.tokens, BLOCK)])
            if i == case.warmup:
                gc.collect()
                gc.freeze()  # as vLLM's engine core does once started
            sync()
            start = now_ns()
            marks: dict[str, int] = {}

            def last_layer_done() -> None:
                stream_sync()
                marks["t0"] = now_ns()

            fwd.run(w, meta, last_layer_done)
            stream_sync()
            t_pub = now_ns()
            conn.send(("saved", {"rid": rid, "t0": marks["t0"], "t_pub": t_pub}))
            forward_ms.append((marks["t0"] - start) / 1e6)
        expect(conn, "tw_done")
    finally:
        gc.unfreeze()  # the worker's cycles (and its NIXL agent) collectable again
        close_worker(w)
    return {"forward_ms": forward_ms}


def anchor_source(conn: Any, case: Case, nixl: Any, src: dict[str, torch.Tensor],
                  p_ids: list[int], device: torch.device) -> dict[str, Any]:
    """The anchors' source side (see the module)."""
    import torch

    from bench.gpu_pipeline import anchors
    from bench.gpu_pipeline.common import expect, now_ns, sync
    from bench.gpu_pipeline.models import BLOCK

    caches = list(src.values())
    mem = anchors.mem_type(device)
    agent = anchors.vllm_style_agent(nixl, f"P-anchor-{uuid.uuid4().hex[:8]}")
    regions = anchors.KVRegions.of(caches)
    regs = [agent.register_memory(agent.get_reg_descs(regions.reg_list(), mem),
                                  backends=["UCX"])]
    dense = case.num_blocks * regions.block_len * len(regions.bases)
    contig = torch.zeros(dense, dtype=torch.uint8, device=device)
    regs.append(agent.register_memory(contig, backends=["UCX"]))
    digest = anchors.blocks_digest(caches, p_ids, list(case.check_layers), case.tokens, BLOCK)
    conn.send(("anchor_hello", {"metadata": bytes(agent.get_agent_metadata()),
                                "regions": regions, "digest": digest,
                                "contig": (contig.data_ptr(), dense,
                                           anchors.device_id(device))}))
    rounds = case.rounds * (("a" in case.anchors) + len(case.contig_descs)
                            * ("b" in case.anchors))
    for _ in range(rounds):
        expect(conn, "ready")
        sync()
        conn.send(("go", {"t0": now_ns()}))
    expect(conn, "anchor_done")
    notifs = 0  # NixlConnector's prefill side learns from these that its blocks were read
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and notifs < case.rounds * ("a" in case.anchors):
        notifs += sum(len(v) for v in agent.get_new_notifs().values())
    for reg in regs:
        agent.deregister_memory(reg, backends=["UCX"])
    return {"notifications": notifs, "dense_bytes": dense}
