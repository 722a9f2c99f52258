"""GPU P/D pipeline without vLLM: encode on GPU0 -> NIXL READ GPU0->GPU1 -> decode on GPU1.

Two processes, one NIXL agent each (one per GPU, so UCX may use CUDA IPC between them; two agents
in one process fell back to TCP through the host in an earlier trial), with paged KV caches shaped
as vLLM's GPU backends allocate them (``[2, num_blocks, block_size, kv_heads, head_dim]`` bf16 per
layer, LBNHC) and Llama-3.1-8B's KV geometry. Per request of T tokens whose blocks are scattered
over the cache:

- **dense** (what NixlConnector does): one prepped NIXL READ of the request's K and V blocks of
  every layer from the prefill cache straight into the decode cache;
- **compressed** (turbowire's path): ``turbowire.kernels.encode_into`` of every layer into a
  contiguous staging buffer on GPU0, one NIXL READ of the payload into a receive buffer on GPU1,
  ``decode_into`` of every layer into the decode cache.

Reported per request: seconds per phase, wire bytes, and dense-equivalent GB/s (dense KV bytes of
the request / seconds). Correctness is checked on each path: dense blocks equal the source; decoded
KV is close to the source (the codec's error). With one GPU both agents share it (said in the
output); ``--cpu`` runs the same on CPU tensors and DRAM (for testing without a GPU).

Needs torch, numpy, NIXL (``nixl_cu13._api``/``nixl_cu12._api``/``nixl._api``) and the installed
package (``turbowire.codec``/``turbowire.kernels``; on the GPU machine ``make gpu-install``, see
bench/README.md); vLLM is not needed.

    python -m turbowire.bench_e2e.gpu_pipeline --tokens 8192,32768 --presets tq4,k4v3 --out /tmp/gpu
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import multiprocessing as mp
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("gpu_pipeline")


def import_nixl() -> Any:
    """The NIXL python API module of whichever variant is installed."""
    for name in ("nixl_cu13._api", "nixl_cu12._api", "nixl._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("no NIXL python API found (nixl_cu13, nixl_cu12 or nixl)")


@dataclass(frozen=True)
class Geometry:
    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16

    @property
    def block_plane_bytes(self) -> int:  # K (or V) of one block of one layer, bf16
        return self.block_size * self.num_kv_heads * self.head_dim * 2

    @property
    def dense_bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 2


@dataclass
class Row:
    path: str  # "dense" or the preset
    tokens: int
    dense_bytes: int
    wire_bytes: int
    encode_s: float = 0.0
    transfer_s: float = 0.0
    decode_s: float = 0.0
    iters: int = 0
    max_abs_err: float = 0.0
    rel_rms_err: float = 0.0
    kernel: str = ""
    samples: dict[str, list[float]] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return self.encode_s + self.transfer_s + self.decode_s


def _device(role: str, args: argparse.Namespace) -> str:
    if args.cpu:
        return "cpu"
    import torch

    n = torch.cuda.device_count()
    idx = 0 if role == "P" or n < 2 else 1
    return f"cuda:{idx}"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def _make_caches(geo: Geometry, num_blocks: int, device: str, fill: bool) -> list[Any]:
    import torch

    caches = []
    g = torch.Generator(device=device).manual_seed(1234)
    for _ in range(geo.num_layers):
        shape = (2, num_blocks, geo.block_size, geo.num_kv_heads, geo.head_dim)
        if fill:  # generated where it lives (GBs of KV on the GPU)
            t = torch.randn(shape, generator=g, dtype=torch.bfloat16, device=device)
        else:
            t = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        caches.append(t)
    return caches


def _mem_type(device: str) -> str:
    return "DRAM" if device == "cpu" else "VRAM"


def _dev_id(device: str) -> int:
    return 0 if device == "cpu" else int(device.split(":")[1])


def _block_descs(caches: list[Any], geo: Geometry, device: str) -> list[tuple[int, int, int]]:
    """(addr, len, dev) of every (layer, plane, block): index = (layer*2 + plane)*NB + block."""
    out = []
    dev = _dev_id(device)
    for cache in caches:
        nb = cache.shape[1]
        for plane in range(2):
            base = cache[plane].data_ptr()
            for b in range(nb):
                out.append((base + b * geo.block_plane_bytes, geo.block_plane_bytes, dev))
    return out


def _request_blocks(num_blocks: int, tokens: int, bs: int, seed: int) -> list[int]:
    import torch

    need = -(-tokens // bs)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    return perm[:need].tolist()


def _chunks(tokens: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(chunk, tokens - s)) for s in range(0, tokens, chunk)]


def _agent(nixl: Any, name: str) -> Any:
    cfg = nixl.nixl_agent_config(backends=["UCX"])
    return nixl.nixl_agent(name, cfg)


def _wait(agent: Any, handle: Any, timeout_s: float = 120.0) -> None:
    t0 = time.perf_counter()
    while True:
        st = agent.check_xfer_state(handle)
        if st == "DONE":
            return
        if st == "ERR":
            raise RuntimeError("NIXL transfer failed")
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"NIXL transfer not done after {timeout_s} s")


# ------------------------------------------------------------------------------------------------
# prefill side


def prefill_main(conn: Any, args: argparse.Namespace) -> None:
    import torch

    from turbowire.codec import Codec
    from turbowire.kernels import EncodeItem, PagedKVLayout, encode_into, triton_launch

    nixl = import_nixl()
    device = _device("P", args)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    geo = Geometry(num_layers=args.layers)
    nb = args.num_blocks
    caches = _make_caches(geo, nb, device, fill=True)
    layout = PagedKVLayout.from_cache(caches[0])
    staging = torch.zeros(args.staging_bytes, dtype=torch.uint8, device=device)
    agent = _agent(nixl, "P")
    agent.register_memory([(c.data_ptr(), c.numel() * 2, _dev_id(device), "") for c in caches],
                          _mem_type(device))
    agent.register_memory([(staging.data_ptr(), staging.numel(), _dev_id(device), "")],
                          _mem_type(device))
    conn.send({"meta": agent.get_agent_metadata(), "blocks": _block_descs(caches, geo, device),
               "staging": (staging.data_ptr(), staging.numel(), _dev_id(device)),
               "device": device, "name": torch.cuda.get_device_name(device)
               if device.startswith("cuda") else "cpu"})
    codecs: dict[str, Any] = {}
    while True:
        msg = conn.recv()
        if msg["cmd"] == "quit":
            break
        if msg["cmd"] == "sample":
            # dense K/V of the request, to check what the decode side received / decoded
            k, v = layout.gather(caches[msg["layer"]], msg["blocks"], 0, msg["tokens"])
            conn.send({"k": k.float().cpu(), "v": v.float().cpu()})
            continue
        if msg["cmd"] != "encode":
            raise ValueError(f"unknown command {msg['cmd']!r}")
        preset, tokens, blocks = msg["preset"], msg["tokens"], msg["blocks"]
        codec = codecs.setdefault(preset, Codec(preset, geo.head_dim, geo.num_layers))
        chunk = int(getattr(codec, "chunk_tokens", 256))
        plan: list[tuple[int, int, int, int, int]] = []  # layer, start, n, offset, nbytes
        off = 0
        items_by_layer = []
        for layer in range(geo.num_layers):
            items = []
            for start, n in _chunks(tokens, chunk):
                size = int(codec.encoded_nbytes(layer, n, geo.num_kv_heads))
                items.append(EncodeItem(blocks, start, n, off, tag=layer * 100003 + start))
                plan.append((layer, start, n, off, size))
                off += size
            items_by_layer.append(items)
        if off > staging.numel():
            raise ValueError(
                f"staging of {staging.numel()} B cannot hold {off} B; raise --staging-bytes")
        _sync(device)
        t0 = time.perf_counter()
        for layer in range(geo.num_layers):
            encode_into(codec, layer, caches[layer], layout, items_by_layer[layer], staging)
        _sync(device)
        enc_s = time.perf_counter() - t0
        conn.send({"encode_s": enc_s, "plan": plan, "wire_bytes": off,
                   "kernel": ("triton" if triton_launch.applies(codec, caches[0])
                              else "reference")})
    del agent


# ------------------------------------------------------------------------------------------------
# decode side (drives the run)


def decode_main(conn: Any, result_q: Any, args: argparse.Namespace) -> None:
    import numpy as np
    import torch

    from turbowire.codec import Codec
    from turbowire.kernels import DecodeItem, PagedKVLayout, decode_into

    nixl = import_nixl()
    device = _device("D", args)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    geo = Geometry(num_layers=args.layers)
    nb = args.num_blocks
    caches = _make_caches(geo, nb, device, fill=False)
    layout = PagedKVLayout.from_cache(caches[0])
    recv = torch.zeros(args.staging_bytes, dtype=torch.uint8, device=device)
    agent = _agent(nixl, "D")
    agent.register_memory([(c.data_ptr(), c.numel() * 2, _dev_id(device), "") for c in caches],
                          _mem_type(device))
    agent.register_memory([(recv.data_ptr(), recv.numel(), _dev_id(device), "")], _mem_type(device))
    hello = conn.recv()
    peer = agent.add_remote_agent(hello["meta"])
    mem = _mem_type(device)
    local_blocks = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _block_descs(caches, geo, device), mem)
    remote_blocks = agent.prep_xfer_dlist(peer, hello["blocks"], mem)
    info = {"prefill_device": hello["device"], "decode_device": device,
            "gpu": hello["name"], "same_device": hello["device"] == device,
            "ucx_tls": os.environ.get("UCX_TLS", "(default)")}
    rows: list[Row] = []

    def idx(blocks: list[int]) -> np.ndarray:
        out = [(layer * 2 + plane) * nb + b for layer in range(geo.num_layers)
               for plane in range(2) for b in blocks]
        return np.asarray(out, dtype=np.int32)

    def check(
        layer: int, p_blocks: list[int], d_blocks: list[int], tokens: int
    ) -> tuple[float, float]:
        conn.send({"cmd": "sample", "layer": layer, "blocks": p_blocks, "tokens": tokens})
        ref = conn.recv()
        k, v = layout.gather(caches[layer], d_blocks, 0, tokens)
        err = torch.cat([(k.float().cpu() - ref["k"]).flatten(),
                         (v.float().cpu() - ref["v"]).flatten()])
        refn = torch.cat([ref["k"].flatten(), ref["v"].flatten()])
        return float(err.abs().max()), float(err.pow(2).mean().sqrt() / refn.pow(2).mean().sqrt())

    # warm-up: connection setup over the first transfer
    wb = _request_blocks(nb, 256, geo.block_size, 7)
    for _ in range(2):
        h = agent.make_prepped_xfer("READ", local_blocks, idx(wb), remote_blocks, idx(wb))
        agent.transfer(h)
        _wait(agent, h)
        agent.release_xfer_handle(h)

    for tokens in args.tokens:
        p_blocks = _request_blocks(nb, tokens, geo.block_size, 11 + tokens)
        d_blocks = _request_blocks(nb, tokens, geo.block_size, 13 + tokens)
        dense_bytes = tokens * geo.dense_bytes_per_token
        n_blocks_bytes = len(p_blocks) * geo.block_plane_bytes * 2 * geo.num_layers
        # dense: one READ of all blocks of all layers
        row = Row("dense", tokens, dense_bytes, n_blocks_bytes, kernel="nixl-read")
        li, ri = idx(d_blocks), idx(p_blocks)
        times = []
        for _ in range(args.iters):
            for c in caches:
                c.zero_()
            _sync(device)
            t0 = time.perf_counter()
            h = agent.make_prepped_xfer("READ", local_blocks, li, remote_blocks, ri)
            agent.transfer(h)
            _wait(agent, h)
            _sync(device)
            times.append(time.perf_counter() - t0)
            agent.release_xfer_handle(h)
        row.transfer_s, row.iters, row.samples = (
            statistics.median(times), len(times), {"transfer": times})
        row.max_abs_err, row.rel_rms_err = check(geo.num_layers - 1, p_blocks, d_blocks, tokens)
        rows.append(row)
        logger.info("dense %d tok: %.2f ms, %.1f GB/s", tokens, row.transfer_s * 1e3,
                    dense_bytes / row.transfer_s / 1e9)
        for preset in args.presets:
            codec = Codec(preset, geo.head_dim, geo.num_layers)
            enc_t, xfer_t, dec_t = [], [], []
            wire = 0
            kernel = ""
            for _ in range(args.iters):
                conn.send({"cmd": "encode", "preset": preset, "tokens": tokens, "blocks": p_blocks})
                rep = conn.recv()
                enc_t.append(rep["encode_s"])
                wire = rep["wire_bytes"]
                kernel = rep["kernel"]
                _sync(device)
                t0 = time.perf_counter()
                saddr, _, sdev = hello["staging"]
                local = agent.get_xfer_descs([(recv.data_ptr(), wire, _dev_id(device))], mem)
                remote = agent.get_xfer_descs([(saddr, wire, sdev)], mem)
                h = agent.initialize_xfer("READ", local, remote, peer)
                agent.transfer(h)
                _wait(agent, h)
                _sync(device)
                xfer_t.append(time.perf_counter() - t0)
                agent.release_xfer_handle(h)
                for c in caches:
                    c.zero_()
                by_layer: dict[int, list[Any]] = {}
                for layer, start, n, off, size in rep["plan"]:
                    by_layer.setdefault(layer, []).append(
                        DecodeItem(d_blocks, start, n, off, size,
                                   expected_tag=layer * 100003 + start))
                _sync(device)
                t0 = time.perf_counter()
                for layer in range(geo.num_layers):
                    decode_into(codec, layer, caches[layer], layout, by_layer[layer], recv)
                _sync(device)
                dec_t.append(time.perf_counter() - t0)
            row = Row(preset, tokens, dense_bytes, wire, encode_s=statistics.median(enc_t),
                      transfer_s=statistics.median(xfer_t), decode_s=statistics.median(dec_t),
                      iters=len(enc_t), kernel=kernel,
                      samples={"encode": enc_t, "transfer": xfer_t, "decode": dec_t})
            row.max_abs_err, row.rel_rms_err = check(geo.num_layers - 1, p_blocks, d_blocks, tokens)
            rows.append(row)
            logger.info("%s %d tok: enc %.2f ms xfer %.2f ms dec %.2f ms (%s)", preset, tokens,
                        row.encode_s * 1e3, row.transfer_s * 1e3, row.decode_s * 1e3, kernel)
    conn.send({"cmd": "quit"})
    result_q.put({"info": info, "rows": [asdict(r) | {"total_s": r.total_s} for r in rows]})


def markdown(result: dict[str, Any]) -> str:
    info = result["info"]
    lines = [f"GPU: {info['gpu']}; prefill {info['prefill_device']} -> decode "
             f"{info['decode_device']}" + (" (same GPU: two NIXL agents in two processes)"
                                           if info["same_device"] else "")
             + f"; UCX_TLS={info['ucx_tls']}", "",
             "| path | tokens | dense MB | wire MB | encode ms | READ ms | decode ms | total ms | "
             "READ GB/s (wire) | dense-equiv. GB/s | kernel | rel. RMS err |",
             "|" + "|".join(["---"] * 12) + "|"]
    for r in result["rows"]:
        total = r["total_s"]
        lines.append(
            f"| {r['path']} | {r['tokens']} | {r['dense_bytes'] / 1e6:.1f} | "
            f"{r['wire_bytes'] / 1e6:.1f} | "
            f"{r['encode_s'] * 1e3:.2f} | {r['transfer_s'] * 1e3:.2f} | "
            f"{r['decode_s'] * 1e3:.2f} | "
            f"{total * 1e3:.2f} | {r['wire_bytes'] / r['transfer_s'] / 1e9:.1f} | "
            f"{r['dense_bytes'] / total / 1e9:.1f} | {r['kernel']} | {r['rel_rms_err']:.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="8192,32768", help="request lengths (comma list)")
    ap.add_argument("--presets", default="tq4,k4v3,tq3", help="codec presets (comma list)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=0,
                    help="cache blocks per layer (0: 1.25x need)")
    ap.add_argument("--staging-bytes", type=int, default=0,
                    help="0: dense size of the longest request")
    ap.add_argument("--cpu", action="store_true", help="CPU tensors and DRAM (test without a GPU)")
    ap.add_argument("--out", type=Path, default=None, help="folder for results.json / results.md")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(processName)s %(message)s")
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    args.presets = [p for p in args.presets.split(",") if p]
    geo = Geometry(num_layers=args.layers)
    need = -(-max(args.tokens) // geo.block_size)
    args.num_blocks = args.num_blocks or int(need * 1.25) + 8
    args.staging_bytes = (
        args.staging_bytes or max(args.tokens) * geo.dense_bytes_per_token + (1 << 20))
    ctx = mp.get_context("spawn")
    p_conn, d_conn = ctx.Pipe()
    result_q = ctx.Queue()
    p = ctx.Process(target=prefill_main, args=(p_conn, args), name="prefill")
    d = ctx.Process(target=decode_main, args=(d_conn, result_q, args), name="decode")
    p.start()
    d.start()
    result = None
    try:
        while result is None:
            try:
                result = result_q.get(timeout=5.0)
            except Exception:
                if not d.is_alive() or not p.is_alive():
                    raise RuntimeError(
                        f"a worker died (prefill rc={p.exitcode}, decode rc={d.exitcode})")
    finally:
        d.join(timeout=30)
        p.join(timeout=30)
        for proc in (p, d):
            if proc.is_alive():
                proc.kill()
    text = markdown(result)
    print(text, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_pipeline.json").write_text(json.dumps(result, indent=1))
        (args.out / "gpu_pipeline.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
